"""A candidate's failures counted apart by kind (report.failures), and an error rate already past
its checklist trigger: records of known truth in the writer's shape (tests/report/synthetic.py).
The gateway-driven case — a candidate at a closed port — is in test_front_door.py."""

from __future__ import annotations

from report.analysis import analyze
from tests.report.synthetic import records


def test_an_adopt_already_past_its_error_rate_trigger_is_not_an_adopt_nor_failing() -> None:
    recs = records(speedups={"chat": 1.5}, n=60, seed=4)
    for r in recs[:6]:  # one candidate leg in ten answers 503: not failing, but erring
        r["legs"][1].update(status=503, outcome="upstream_status", error_type="HTTP 503")
    a = analyze(recs)
    c = a.candidates["candidate-backend"]
    assert not c.failing and c.failures.http == {503: 6} and c.failures.attempted == 60
    chat = next(v for v in c.verdicts if v.category == "chat")
    assert chat.decision == "do_not_adopt", chat.reasons
    assert chat.reasons[0].startswith("measured error rate 10.0% (6 of 60 legs) is already past")
    assert a.recommendations["chat"].backend is None


def test_failures_are_counted_apart_by_kind() -> None:

    recs = records(speedups={"chat": 1.5}, n=12, seed=5)
    ends = [
        {"status": None, "outcome": "upstream_error", "error_type": "UpstreamConnectError"},
        {"status": None, "outcome": "upstream_timeout", "error_type": "UpstreamTimeout"},
        {"status": None, "outcome": "deadline", "error_type": None},
        {"status": 502, "outcome": "upstream_status", "error_type": "HTTP 502"},
        {"status": 200, "outcome": "parse_error", "error_type": "JSONDecodeError"},
        {"status": None, "outcome": "client_disconnected", "error_type": None},  # not its fault
    ]
    for r, end in zip(recs, ends, strict=False):
        r["legs"][1].update(end)
    recs[6]["legs"].pop(1)
    recs[6]["sampling"] = {"dropped": [{"backend": "candidate-backend", "reason": "breaker_open"}]}
    recs[7]["legs"].pop(1)
    recs[7]["sampling"] = {"dropped": [{"backend": "candidate-backend", "reason": "budget"},
                                       {"backend": "another", "reason": "breaker_open"}]}  # fmt: skip
    f = analyze(recs).candidates["candidate-backend"].failures
    assert (f.connect, f.timeout, dict(f.http), dict(f.other)) == (
        1, 2, {502: 1}, {"JSONDecodeError": 1},
    )  # fmt: skip
    assert (f.breaker, f.budget, f.sent, f.attempted, f.failed) == (1, 1, 9, 10, 5)
    assert f.first is not None and f.first.kind == "UpstreamConnectError"
    assert f.failing  # 6 of 10 attempted (5 failed, 1 breaker-dropped): more than half
    assert f.counts() == (
        "1 could not connect, 1 HTTP error (1× 502), 2 timed out, "
        "1 other error (1× JSONDecodeError), 1 dropped with its breaker open"
    )
