"""The shared rollout store's contract, on real SQLite (two connections, as two processes hold
them) and on the real ClickHouse server ``scripts/bootstrap`` installs: a compare-and-set takes
one writer per version, a rollback wins a race at one version and cannot be undone by a writer
that had not seen it, the chain and the pooled evidence read back the same after a restart, in
the same order for every reader."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.procs import ChildProcess, free_port, wait_http_ready
from policies.compiled import GuardSpec
from records.stores import parse_store
from rollout.fleet import decode, encode, local_spec, pooled_spec
from rollout.guards import Observation
from rollout.state import RuleState, Transition
from rollout.store import (
    SharedStore,
    SqliteStateStore,
    StoredState,
    StoreError,
    parse_state_url,
    resolve,
)
from rollout.store_clickhouse import ClickHouseStateStore
from tests.receivers.clickhouse import ClickHouseServer, requires_clickhouse

Opener = Callable[[], SharedStore]


def state(
    stage: str, *, rolled_back: bool = False, by: str = "operator", at: float = 1.0
) -> RuleState:
    t = Transition("r", "canary", stage, 0.3, at, by, f"to {stage}")  # type: ignore[arg-type]
    return RuleState(stage, "fp", 0, rolled_back, at, last=t, episode="e1")  # type: ignore[arg-type]


def observation(i: int) -> Observation:
    return Observation("candidate", True, True, 0.01 * i, None, 0.01, None, 1.5, None, None)


def check_contract(open_store: Opener, restart: Callable[[], None] | None = None) -> None:
    a, b = open_store(), open_store()
    assert a.current() == {}
    first = a.cas("r", None, state("canary", at=1.0), "a")
    assert first is not None and first.version == 1
    assert b.cas("r", None, state("live", at=1.5), "b") is None  # b computed from nothing: stale
    assert b.current()["r"].state.stage == "canary"

    # A race at one version: a promotion and a rollback both built on version 1. Only one
    # writer gets the version; whichever lands, the rollback is the state afterwards.
    head = b.current()["r"]
    rollback = a.cas("r", head, state("shadow", rolled_back=True, by="guard", at=2.0), "a")
    promote = b.cas("r", head, state("live", at=2.1), "b")
    assert rollback is not None and rollback.version == 2
    assert promote is None, "a writer that had not seen the rollback undid it"
    # ... and nothing built on the losing side ever joins the chain.
    assert b.cas("r", head, state("live", at=2.2), "b") is None
    assert [s.state.stage for s in a.history("r")] == ["canary", "shadow"]
    # An operator who has seen the rollback may promote again: version 3.
    again = b.cas("r", b.current()["r"], state("canary", at=3.0), "b")
    assert again is not None and again.version == 3

    # Pooled evidence: both writers' rows, one order for every reader.
    a.append([("r", "e1", "a", i, encode(observation(i), f"x{i}", None)) for i in range(3)])
    b.append([("r", "e1", "b", i, encode(observation(10 + i), f"y{i}", None)) for i in range(2)])
    a.append([("r", "e2", "a", 9, encode(observation(99), None, None))])  # another episode

    def read(store: SharedStore) -> list[str | None]:
        cursor, out = None, list[str | None]()
        while True:
            cursor, rows = store.evidence("r", "e1", cursor, 2)  # pages of 2: the cursor moves
            if not rows:
                return out
            out += [decode(body)[1] for body in rows]

    order = read(a)
    assert sorted(order, key=str) == ["x0", "x1", "x2", "y0", "y1"] and read(b) == order
    k1, k2 = a.register("a", 1.0), b.register("b", 2.0)
    assert {k1, k2} == {1, 2}

    a.close()
    b.close()
    if restart is not None:
        restart()
    c = open_store()  # a new replica (or every replica after the store's restart) reads it back
    assert [s.state.stage for s in c.history("r")] == ["canary", "shadow", "canary"]
    assert c.current()["r"].version == 3 and c.current()["r"].state.episode == "e1"
    assert read(c) == order
    c.close()


def test_the_sqlite_store_keeps_the_contract(tmp_path: Path) -> None:
    check_contract(lambda: SqliteStateStore(str(tmp_path / "state.db")))


def test_sqlite_compare_and_set_takes_one_writer_per_version_across_threads(tmp_path: Path) -> None:
    """Eight writers on eight connections, each retrying on its own view: every version written
    once, the chain unbroken."""
    path = str(tmp_path / "state.db")
    SqliteStateStore(path).cas("r", None, state("canary"), "init")
    won: list[int] = []

    def writer(i: int) -> None:
        store = SqliteStateStore(path)
        for _ in range(20):
            head = store.current()["r"]
            done = store.cas("r", head, state("canary", at=float(i)), f"w{i}")
            if done is not None:
                won.append(done.version)
        store.close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    chain = SqliteStateStore(path).history("r")
    assert sorted(won) == list(range(2, len(chain) + 1))
    assert [s.version for s in chain] == list(range(1, len(chain) + 1))
    assert resolve(chain) == chain


def test_racing_inserts_at_one_version_resolve_to_the_rollback_and_drop_what_was_built_on_the_loser() -> (
    None
):
    """ClickHouse has no transactions: two writers that read version 1 both insert version 2.
    The chain keeps the rollback, and a version 3 built on the promotion is not part of it."""
    one = StoredState("r", 1, "a1", "", 1, "a", 1.0, state("canary"))
    promote = StoredState("r", 2, "p2", "a1", 1, "b", 2.0, state("live", at=2.0))
    rollback = StoredState("r", 2, "r2", "a1", 2, "c", 2.5, state("shadow", rolled_back=True))
    on_promote = StoredState("r", 3, "p3", "p2", 1, "b", 3.0, state("live", at=3.0))
    for rows in ([one, promote, rollback, on_promote], [on_promote, rollback, promote, one]):
        assert [r.row_id for r in resolve(rows)] == ["a1", "r2"]
    twins = [one, promote, StoredState("r", 2, "q2", "a1", 1, "d", 1.9, state("live"))]
    assert [r.row_id for r in resolve(twins)] == ["a1", "q2"]  # the earlier of two equals


def test_a_state_url_names_a_file_sqlite_or_clickhouse_and_a_bad_one_says_why() -> None:
    assert parse_state_url("/var/lib/specshadow/rollout.json").kind == "file"
    url = parse_state_url("sqlite:///var/lib/specshadow/rollout.db?poll_s=0.25")
    assert (url.kind, url.path, url.poll_s) == ("sqlite", "/var/lib/specshadow/rollout.db", 0.25)
    url = parse_state_url("clickhouse://ops:pw@ch.internal:8124/fleet")
    assert (url.host, url.port, url.database, url.user, url.password) == (
        "ch.internal", 8124, "fleet", "ops", "pw",
    )  # fmt: skip
    for bad, why in [
        ("sqlite://", "no file path"),
        ("clickhouse:///db", "no host"),
        ("clickhouse://ch/db;drop", "plain identifier"),
        ("redis://r/0", "unknown scheme"),
        ("sqlite:///x.db?poll=1", "unknown option"),
        ("sqlite:///x.db?poll_s=0", r"\?poll_s= must be in \(0, 60\]"),
        ("sqlite:///x.db?poll_s=often", r"\?poll_s= must be a number"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_state_url(bad)


def test_state_and_record_store_urls_are_read_by_one_parser() -> None:
    """``--state`` and ``--store`` name a ClickHouse server or a SQLite file alike: the same URL
    gives the same server, and the same mistake the same line."""
    text = "clickhouse://ops:pw@ch.internal:8124/fleet"
    state, store = parse_state_url(text), parse_store(text)
    assert (state.host, state.port, state.database, state.user, state.password) == (
        store.host, store.port, store.database, store.user, store.password,
    )  # fmt: skip
    assert parse_state_url("sqlite:///a/b.db").path == parse_store("sqlite:///a/b.db").path

    def error(parse: Callable[[str], object], text: str) -> str:
        with pytest.raises(ValueError, match=r"^\S+: ") as caught:
            parse(text)
        return str(caught.value)

    for bad in ("clickhouse:///db", "clickhouse://ch:port/db", "clickhouse://ch/db;drop"):
        assert error(parse_state_url, bad) == error(parse_store, bad)
    # The example path names what each store holds; the rest of the line is the same.
    assert error(parse_state_url, "sqlite://").replace("rollout.db", "records.sqlite") == error(
        parse_store, "sqlite://"
    )


def test_the_false_alarm_budget_sums_to_alpha_over_any_number_of_replicas() -> None:
    spec = GuardSpec(confidence=0.99)
    alphas = [1 - pooled_spec(spec).confidence] + [
        1 - local_spec(spec, k).confidence for k in range(1, 100_000)
    ]
    assert sum(alphas) <= 0.01 + 1e-12
    assert sum(alphas) > 0.0099  # and nearly all of it is spent


@pytest.fixture(scope="module")
def clickhouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseServer]:
    with ClickHouseServer(tmp_path_factory.mktemp("clickhouse")) as server:
        yield server


@requires_clickhouse
def test_the_clickhouse_store_keeps_the_contract_across_a_server_restart(
    clickhouse: ClickHouseServer,
) -> None:
    url = parse_state_url(clickhouse.url("rollout_contract"))

    def open_store() -> SharedStore:
        return ClickHouseStateStore(url, settle_s=0.0)

    check_contract(open_store, restart=lambda: restart_clickhouse(clickhouse))


@requires_clickhouse
def test_an_unreachable_clickhouse_is_a_store_error_not_a_hang(
    clickhouse: ClickHouseServer,
) -> None:
    url = parse_state_url(f"clickhouse://127.0.0.1:{free_port()}/nothing")
    with pytest.raises(StoreError, match=r"127\.0\.0\.1"):
        ClickHouseStateStore(url, timeout_s=1.0).current()


def restart_clickhouse(server: ClickHouseServer) -> None:
    """Stop the server and start it again on the same port and data (tests only)."""
    proc = server._proc
    argv = list(proc.argv)
    proc.stop(10.0)
    server._proc = ChildProcess(argv, name="clickhouse-server", log_path=proc.log_path)
    wait_http_ready(f"http://127.0.0.1:{server.port}/ping", server._proc, 60.0)
