"""Hot reload on a real file system: atomic replace, k8s ..data swap, delete/restore, SIGHUP."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from blockbuster import blockbuster_ctx

from policies import PolicyError, PolicyStore, reload_now, watch_policy_file

INTERVAL_S = 0.05
DEADLINE_S = 5.0


def policy_text(ratio: float, *, kill_switch: bool = False) -> str:
    return (
        "version: 1\n"
        "backends:\n  cand: {url: 'http://127.0.0.1:9001', kind: vllm}\n"
        f"default: {{ratio: {ratio}, legs: [{{backend: cand}}]}}\n"
        f"kill_switch: {'true' if kill_switch else 'false'}\n"
    )


INVALID = "version: 1\ndefault: {ratio: 1.5, legs: []}\n"


def write_in_place(path: Path, text: str) -> None:
    path.write_text(text)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rewrite_keeping_stat(path: Path, text: str) -> tuple[os.stat_result, os.stat_result]:
    """Overwrite in place, then restore the mtime: only the content tells the change apart."""
    before = path.stat()
    with path.open("r+") as f:
        f.write(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return before, path.stat()


def last_reload(store: PolicyStore) -> tuple[bool, str | None]:
    return store.last_reload_ok, store.last_error


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"not within {DEADLINE_S} s: {what}")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def watching(
    path: Path, store: PolicyStore, *, sighup: bool = False, interval_s: float = INTERVAL_S
) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(watch_policy_file(path, store, interval_s=interval_s, sighup=sighup))
    try:
        await asyncio.sleep(3 * INTERVAL_S)  # let it take its first fingerprint
        yield task
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.fixture
def policy_path(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_text(0.1))
    return path


def test_store_starts_at_generation_one_and_reports_status(policy_path: Path) -> None:
    store = PolicyStore.open(policy_path)
    status = store.status_dict()
    assert status["generation"] == 1 and status["source"] == str(policy_path)
    assert status["sha256"] == store.current.sha256 and status["rules"] == ["default"]
    assert str(status["loaded_at"]).endswith("+00:00")
    assert status["last_reload"] == {
        "ok": True,
        "error": None,
        "at": None,
        "reloads": 0,
        "failures": 0,
    }


def test_startup_with_an_invalid_policy_fails_fast(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(INVALID)
    with pytest.raises(PolicyError, match=r"^default\.ratio: must be between 0 and 1, got 1\.5$"):
        PolicyStore.open(path)


def test_reload_now_keeps_the_last_good_policy_on_a_missing_file(policy_path: Path) -> None:
    store = PolicyStore.open(policy_path)
    policy_path.unlink()
    assert reload_now(policy_path, store) is False
    assert store.generation == 1 and store.reload_failures == 1
    assert store.last_error is not None and store.last_error.startswith("FileNotFoundError")


async def test_valid_atomic_replace_bumps_the_generation(policy_path: Path) -> None:
    store = PolicyStore.open(policy_path)
    with blockbuster_ctx():  # the watcher must do no blocking I/O on the event loop
        async with watching(policy_path, store):
            await asyncio.to_thread(write_atomic, policy_path, policy_text(0.2))
            await eventually(lambda: store.generation == 2, "generation 2")
    assert store.current.default_rule is not None
    assert [leg.share for leg in store.current.default_rule.legs] == [0.2]
    assert store.reloads == 1 and store.last_reload_ok


async def test_invalid_change_keeps_the_previous_generation_and_counts_a_failure(
    policy_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = PolicyStore.open(policy_path)
    kept = store.current
    async with watching(policy_path, store):
        with caplog.at_level(logging.WARNING, logger="policies.watch"):
            write_atomic(policy_path, INVALID)
            await eventually(lambda: store.reload_failures == 1, "one failure")
        assert store.current is kept and store.generation == 1
        assert store.last_reload_ok is False
        assert store.last_error == "default.ratio: must be between 0 and 1, got 1.5"
        assert str(policy_path) in caplog.text and "keeping generation 1" in caplog.text
        status = store.status_dict()["last_reload"]
        assert isinstance(status, dict) and status["ok"] is False and status["failures"] == 1

        write_atomic(policy_path, policy_text(0.3))  # a fix is picked up again
        await eventually(lambda: store.generation == 2, "generation 2 after the fix")
    assert last_reload(store) == (True, None)


async def test_in_place_write_is_seen(policy_path: Path) -> None:
    store = PolicyStore.open(policy_path)
    async with watching(policy_path, store):
        write_in_place(policy_path, policy_text(0.9))
        await eventually(lambda: store.generation == 2, "generation 2")


async def test_same_size_write_with_unchanged_stat_is_seen_by_its_content(
    policy_path: Path,
) -> None:
    # Models the coarse-timestamp trap: same inode, same size, same mtime — only content differs.
    store = PolicyStore.open(policy_path)
    async with watching(policy_path, store):
        before, after = rewrite_keeping_stat(policy_path, policy_text(0.7))  # same length as 0.1
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        )
        await eventually(lambda: store.generation == 2, "generation 2")


async def test_rewriting_identical_content_does_not_bump_the_generation(policy_path: Path) -> None:
    store = PolicyStore.open(policy_path)
    async with watching(policy_path, store):
        write_atomic(policy_path, policy_text(0.1))
        await eventually(lambda: store.reloads == 1, "one reload")
    assert store.generation == 1 and store.reload_failures == 0


async def test_kubernetes_data_symlink_swap_is_seen(tmp_path: Path) -> None:
    # ConfigMap volume layout: policy.yaml → ..data/policy.yaml, ..data → ..2026_01 (a directory).
    (tmp_path / "..2026_01").mkdir()
    (tmp_path / "..2026_01" / "policy.yaml").write_text(policy_text(0.1))
    os.symlink("..2026_01", tmp_path / "..data")
    path = tmp_path / "policy.yaml"
    os.symlink("..data/policy.yaml", path)
    store = PolicyStore.open(path)
    async with watching(path, store):
        (tmp_path / "..2026_02").mkdir()
        (tmp_path / "..2026_02" / "policy.yaml").write_text(policy_text(0.4, kill_switch=True))
        os.symlink("..2026_02", tmp_path / "..data_tmp")
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")  # the atomic swap
        await eventually(lambda: store.generation == 2, "generation 2 after the swap")
    assert store.current.kill_switch is True
    assert store.current.source == str(path)


async def test_deleted_file_keeps_the_policy_and_a_restored_file_is_loaded(
    policy_path: Path,
) -> None:
    store = PolicyStore.open(policy_path)
    kept = store.current
    async with watching(policy_path, store):
        os.unlink(policy_path)
        await eventually(lambda: store.reload_failures == 1, "failure on deletion")
        assert store.current is kept
        await asyncio.sleep(4 * INTERVAL_S)
        assert store.reload_failures == 1  # a missing file is reported once, not every poll
        write_atomic(policy_path, policy_text(0.5))
        await eventually(lambda: store.generation == 2, "generation 2 after restore")
    assert store.last_reload_ok


async def test_change_between_startup_load_and_watcher_start_is_picked_up(
    policy_path: Path,
) -> None:
    store = PolicyStore.open(policy_path)
    write_atomic(policy_path, policy_text(0.6))
    async with watching(policy_path, store):
        await eventually(lambda: store.generation == 2, "generation 2")


async def test_sighup_reloads_at_once(policy_path: Path) -> None:
    store = PolicyStore.open(policy_path)
    async with watching(policy_path, store, sighup=True, interval_s=3600):
        write_atomic(policy_path, policy_text(0.8))
        os.kill(os.getpid(), signal.SIGHUP)
        await eventually(lambda: store.generation == 2, "generation 2 after SIGHUP")
        os.kill(os.getpid(), signal.SIGHUP)  # unchanged content: a reload, no new generation
        await eventually(lambda: store.reloads == 2, "second reload")
    assert store.generation == 2
    # The handler is removed with the watcher: SIGHUP is back to its previous disposition.
    assert not asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)


async def test_primary_url_override_survives_reloads(policy_path: Path) -> None:
    text = policy_text(0.1).replace(
        "backends:\n", "backends:\n  prod: {url: 'http://old:1', kind: openai}\n"
    )
    write_atomic(policy_path, text + "primary: prod\n")
    store = PolicyStore.open(policy_path, primary_url="http://127.0.0.1:7000")
    async with watching(policy_path, store):
        write_atomic(policy_path, text.replace("0.1", "0.2") + "primary: prod\n")
        await eventually(lambda: store.generation == 2, "generation 2")
    assert (
        store.current.primary is not None and store.current.primary.url == "http://127.0.0.1:7000"
    )


def test_replace_bumps_the_generation_and_returns_the_stored_policy(policy_path: Path) -> None:
    store = PolicyStore.open(policy_path)
    other = PolicyStore.open(policy_path).current
    stored = store.replace(other)
    assert stored.generation == 2 and store.current is stored and other.generation == 1
