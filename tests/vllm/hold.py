"""Start the vllm tier's four shared servers ahead of the tier and hold them until told to stop.

``scripts/check`` runs ``python -m tests.vllm.hold URLS_FILE`` in the background when a run
includes the vllm tier: the four starts of :data:`tests.vllm.conftest.SERVER_SPECS` (about 88 s,
CPU-bound, on two cores) then overlap the lint and the functional tier instead of opening the
vllm tier, which finds them ready through ``SPECSHADOW_VLLM_URLS`` (the fixture's reuse path).
The servers are the fixture's own specs (models, cores, the shared model-info cache), so the
tier sees what it would have started itself.

When they are ready it writes ``plain=URL,baseline=URL,ngram=URL,draft=URL`` to ``URLS_FILE``
(atomically), then waits for SIGTERM or SIGINT — or for its parent to go away, so an interrupted
check leaves no server behind. Then it stops them and, as the fixture does, fails (exit 1) if a
server left a process or its work folder behind. A failed start exits 1 without the file:
scripts/check then lets the tier start its own servers and report the error there.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from backends.server import VllmServerSpec, session_pids, start_servers, stop_servers
from backends.setup import VllmEnv, setup
from tests.vllm.conftest import SERVER_SPECS


def hold(
    out: Path,
    env: VllmEnv,
    stop: threading.Event,
    alive: Callable[[], bool] = lambda: True,
    specs: Sequence[VllmServerSpec] = SERVER_SPECS,
) -> int:
    """Start ``specs``, write their URLs to ``out``, wait for ``stop`` (or ``alive()`` False),
    stop them; 0, or 1 if one left a process or its work folder behind."""
    servers = start_servers(specs, env)
    leaders = {s.spec.name: s.pid for s in servers}
    work_dirs = [s.work_dir for s in servers]
    try:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(",".join(f"{s.spec.name}={s.base_url}" for s in servers))
        tmp.replace(out)
        print(f"hold: {len(servers)} vLLM servers ready ({out})", flush=True)
        while not stop.wait(1.0) and alive():
            pass
    finally:
        stop_servers(servers)
    stray = {name: session_pids(pid) for name, pid in leaders.items() if pid is not None}
    left = [d for d in work_dirs if d is not None and d.exists()]
    if any(stray.values()) or left:
        print(f"hold: stray vLLM processes {stray}, work folders left {left}", file=sys.stderr)
        return 1
    print("hold: servers stopped, nothing left behind", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.vllm.hold URLS_FILE", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()
    return hold(Path(argv[0]), setup(), stop, alive=lambda: os.getppid() == parent)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
