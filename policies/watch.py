"""Hot reload: watch the policy file (and SIGHUP), swap in valid changes, keep the last good one.

Envoy's semantics as one asyncio task: the initial load must succeed (``PolicyStore.open``); later
a valid change bumps the generation, while an invalid, unreadable or missing file is logged and
counted and the previous policy keeps serving. All file I/O runs in a worker thread.

What counts as a change: the fingerprint of the *resolved* file — ``realpath`` plus ``os.stat``
following symlinks (device, inode, size, mtime) plus a hash of the content. The resolved path and
inode catch an atomic ``os.replace`` and the Kubernetes ConfigMap swap (``policy.yaml`` →
``..data/policy.yaml``, with ``..data`` a symlink renamed over atomically). The content hash is
there because file timestamps come from a coarse kernel clock (a jiffy, up to 10 ms) and inode
numbers are reused, so two quick same-size writes can leave stat unchanged; a policy file is a few
KB, so hashing it every second costs nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import time
from typing import NamedTuple

from policies.compile import load_policy
from policies.errors import PolicyError
from policies.store import PolicyStore

log = logging.getLogger(__name__)


class Fingerprint(NamedTuple):
    realpath: str
    st_dev: int
    st_ino: int
    st_size: int
    st_mtime_ns: int
    sha256: str


def fingerprint(path: str | os.PathLike[str]) -> Fingerprint | None:
    """The resolved file's identity and content hash; None when it does not exist or is unreadable."""
    try:
        real = os.path.realpath(path)
        with open(real, "rb") as f:
            st = os.fstat(f.fileno())
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None
    return Fingerprint(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, digest)


def reload_now(path: str | os.PathLike[str], store: PolicyStore) -> bool:
    """Load ``path`` and make it current if valid; keep the current policy otherwise.

    Blocking (reads the file): call it from a worker thread, e.g. via :func:`reload_in_thread`.
    Returns True when the file was valid (whether or not its content changed).
    """
    now = time.time_ns()
    try:
        policy = load_policy(path, primary_url=store.primary_url)
    except (PolicyError, OSError) as exc:
        error = str(exc) if isinstance(exc, PolicyError) else f"{type(exc).__name__}: {exc}"
        # Logged before it is counted: whoever sees the failure count (the status endpoint, a
        # test polling from the event loop while this runs in a worker thread) finds its log
        # line already written.
        log.warning(
            "policy reload from %s rejected; keeping generation %d: %s",
            os.fspath(path),
            store.generation,
            error.replace("\n", "; "),
        )
        store.record_failure(error, at_unix_ns=now)
        return False
    if store.record_reload(policy, at_unix_ns=now):
        log.info(
            "policy reloaded from %s: generation %d, sha256 %s",
            os.fspath(path),
            store.generation,
            policy.sha256[:12],
        )
    return True


async def reload_in_thread(path: str | os.PathLike[str], store: PolicyStore) -> bool:
    """:func:`reload_now` off the event loop."""
    return await asyncio.to_thread(reload_now, path, store)


async def watch_policy_file(
    path: str | os.PathLike[str],
    store: PolicyStore,
    *,
    interval_s: float = 1.0,
    sighup: bool = False,
) -> None:
    """Poll ``path`` every ``interval_s`` and reload on change; runs until cancelled.

    Args:
        sighup: also reload at once on SIGHUP (even when the file looks unchanged). The handler
            is installed on the running loop for the watcher's lifetime (main thread only).
    """
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()
    if sighup:
        loop.add_signal_handler(signal.SIGHUP, wake.set)
    try:
        seen = await asyncio.to_thread(fingerprint, path)
        if seen is None or seen.sha256 != store.current.sha256:
            # Changed (or gone) between the initial load and now: report it, keep the old one.
            await reload_in_thread(path, store)
        while True:
            forced = await _wait(wake, interval_s)
            now = await asyncio.to_thread(fingerprint, path)
            if forced or now != seen:
                seen = now
                await reload_in_thread(path, store)
    finally:
        if sighup:
            loop.remove_signal_handler(signal.SIGHUP)


async def _wait(wake: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to ``timeout_s``; True when woken by ``wake`` (which is then cleared)."""
    try:
        async with asyncio.timeout(timeout_s):
            await wake.wait()
    except TimeoutError:
        return False
    wake.clear()
    return True
