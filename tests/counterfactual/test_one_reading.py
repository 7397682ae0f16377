"""The counterfactual matrix and the report read one record the same way (issue 28).

Records come from the writer (:func:`records.writer.build_record`): exchanges with no category
(no header, no body to classify), and legs that failed after their first byte — outcome
``upstream_error`` with status 200, output text, a TPOT and a token count, everything a step-time
point needs except having completed. The matrix must file them under the report's category name
and fit its step model on exactly the legs the report counts as completed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.classify import ALL, UNCATEGORIZED
from core.exchange import CaptureSpec, LegLoad, LegResult, Role, SpeculativeSpec, TokenIds
from core.timings import StreamOutcome
from counterfactual.matrix import build_matrix
from evidence.worker import backend_facts, build_evidence
from records.reader import read_all
from records.writer import build_record
from report.population import population_of
from tests.otel.exchanges import STARTED_UNIX_NS, make_exchange, make_leg, make_recording

FULL = CaptureSpec(text="full", redact=frozenset())
LOAD = LegLoad(in_flight=3, rate_rps=12.0, window_s=10.0, replicas=2)
SPEC = SpeculativeSpec(
    method="ngram",
    num_speculative_tokens=3,
    label="ngram-3",
    prompt_lookup_min=2,
    prompt_lookup_max=3,
)
METRICS = {
    "speculative_decoding": {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6}
}
PROMPT = (5, 6, 7, 8, 9, 5, 6, 7)
OUTPUT = (5, 6, 7, 8, 1, 2, 5, 6, 7, 8)


def leg(role: Role, *, failed: bool) -> LegResult:
    """A leg at a known load; ``failed``: the upstream died mid-stream after some output."""
    outcome: StreamOutcome = "upstream_error" if failed else "completed"
    metrics = METRICS if role == "candidate" else None
    made = make_leg(
        role,
        backend="vllm-ngram" if role == "candidate" else "primary",
        outcome=outcome,
        status=200,  # the headers had arrived
        error_type="ClientPayloadError" if failed else None,
        recording=make_recording(outcome=outcome, vllm_metrics=metrics),
    )
    return dataclasses.replace(made, load=LOAD, speculative=SPEC if role == "candidate" else None)


def record(
    i: int, *, primary_failed: bool = False, candidate_failed: bool = False
) -> dict[str, Any]:
    ex = make_exchange(category=None, shadows=(leg("candidate", failed=candidate_failed),))
    ex = dataclasses.replace(
        ex,
        exchange_id=f"ex-{i}",
        started_unix_ns=STARTED_UNIX_NS + i,
        request_json=None,  # nothing to classify: the record's category is null
        primary=leg("primary", failed=primary_failed),
        tokens=TokenIds(
            source="tokenize:vllm-ngram",
            leg="primary",
            prompt=PROMPT,
            output=OUTPUT,
            drafters={},
            legs={"vllm-ngram": OUTPUT},
        ),
    )
    return build_record(
        build_evidence(ex, capture_default=FULL), capture=FULL, facts=backend_facts()
    )


def records() -> list[dict[str, Any]]:
    return [
        *(record(i) for i in range(4)),
        record(4, primary_failed=True),
        record(5, candidate_failed=True),
    ]


def test_the_matrix_and_the_report_agree_on_category_and_completed_legs() -> None:
    raw = records()
    assert all(r["category"] is None for r in raw)
    failed = [leg for r in raw for leg in r["legs"] if leg["outcome"] == "upstream_error"]
    # each failed leg carries what a step-time point needs: only the completed rule keeps it out
    assert len(failed) == 2
    assert all(leg["output"]["text"] and leg["tpot_s"] and leg["output_tokens"] for leg in failed)

    m = build_matrix(lambda: raw, depths=(2, 3), windows=((2, 3),))
    views = read_all(raw)
    population = population_of(raw)

    # one category name: the reader's, the report's population and the matrix's rows and picks
    assert {r.category for r in views} == {UNCATEGORIZED}
    assert population.categories == (UNCATEGORIZED,)
    assert {row["category"] for row in m.rows} == {UNCATEGORIZED, ALL}
    assert set(m.picks) <= {UNCATEGORIZED, ALL}
    assert set(population.exclusions["vllm-ngram"]) <= {UNCATEGORIZED, ALL}

    # one completed-leg rule: the step model's points are the legs the report counts as completed
    completed = sum(leg.ok for r in views for leg in r.legs)
    assert completed == 2 * len(raw) - len(failed) == 10
    assert m.model is not None and m.model.points == completed
    # and the report excludes the failed exchanges for the failed leg, by the same rule
    excluded = population.exclusions["vllm-ngram"][UNCATEGORIZED]
    assert sum(n for reason, n in excluded.items() if "upstream_error" in reason) == len(failed)

    # the live candidate's configuration and its own ids come through the reader too
    assert [(live["backend"], live["label"]) for live in m.live] == [
        ("vllm-ngram", "ngram k=3 lookup 2-3")
    ]
    assert m.live[0]["engine_check"] is not None
