"""``specshadow serve --workers N``: the product run as N worker processes on one port.

The supervisor (:mod:`gateway.workers`) binds the port and forks; this module is what each
worker runs — the same application ``serve`` builds for one process (:func:`specshadow.app.build_app`),
with three differences:

- ``GET /metrics`` describes the whole gateway: the pull reader is an
  :class:`otel.multiproc.FleetPullReader` over the gateway's run folder;
- OTLP export carries the worker's own resource attributes (``service.instance.id`` =
  ``<gateway id>-<index>``, ``specshadow.worker.index``, ``specshadow.worker.count``,
  ``process.pid``), so a collector tells the workers apart;
- every response names the worker that answered (``x-specshadow-worker``), and ``GET
  /admin/workers`` lists the set.

Rollout state must be shared by the workers: ``serve`` refuses a JSON state file with more than
one worker and defaults to a SQLite store (see :func:`state_for_workers`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from core.faults import Fault
from gateway.serve import serve_app
from gateway.settings import Settings
from gateway.workers import (
    Supervisor,
    WorkerIdentity,
    bind_sockets,
    install,
    make_run_dir,
    status_families,
)
from otel.multiproc import FleetPullReader
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from policies.errors import PolicyError
from policies.store import PolicyStore
from rollout.store import StoreError
from specshadow.app import build_app

log = logging.getLogger(__name__)

SQLITE_STATE = "rollout.sqlite"


def state_for_workers(
    given: str | None, default_file: str, workers: int
) -> tuple[str | None, str | None]:
    """(the ``--state`` to use, a problem) for ``workers`` processes.

    One worker keeps today's behaviour (``given``, else the JSON file). More than one cannot share
    a JSON file (each process would overwrite the others' state): a given file path is refused;
    without ``--state`` the state is ``sqlite:///`` a ``rollout.sqlite`` beside the default JSON
    file — persistent, like it, so a rollback survives a restart of the gateway.
    """
    if workers <= 1:
        return given or default_file, None
    if given is None:
        return f"sqlite://{Path(default_file).with_name(SQLITE_STATE).resolve()}", None
    if "://" not in given:
        return None, (
            f"--state {given}: {workers} workers cannot share a JSON state file; give a shared "
            f"store: --state sqlite://{Path(given).with_suffix('.sqlite').resolve()} (one host) "
            "or clickhouse://host:port/db"
        )
    return given, None


def run_workers(
    settings: Settings,
    policy: PolicyStore,
    *,
    count: int,
    environ: Mapping[str, str] = os.environ,
) -> int:
    """Bind, fork ``count`` workers and supervise them until SIGTERM; the exit status.

    Raises :class:`gateway.serve.ListenError` (one line) when the port cannot be bound.
    """
    sockets = bind_sockets(settings.host, settings.port, count)
    port = sockets[0][0].getsockname()[1]
    run_dir = make_run_dir()
    telemetry_settings = TelemetrySettings.from_env(environ)  # checked once, in the parent

    def main(
        identity: WorkerIdentity, socks: list[socket.socket], ready: Callable[[], None]
    ) -> int:
        reader = FleetPullReader(
            identity.metrics_dir,
            worker=identity.index,
            extra=lambda: status_families(identity.run_dir),
        )
        try:
            telemetry = build_telemetry(
                telemetry_settings,
                pull_reader=reader,
                process_attributes=identity.resource_attributes(),
            )
            app = build_app(settings, policy=policy, telemetry=telemetry)
        except (PolicyError, Fault, StoreError, OSError, ValueError) as exc:
            # What one process would refuse to start on (an unusable --store, a state store that
            # cannot be opened): status 2 makes the parent stop at once instead of retrying.
            sys.stderr.write(f"specshadow serve: worker {identity.index}: {exc}\n")
            return 2
        install(app, identity, ready)
        if telemetry_settings.enabled and telemetry_settings.prometheus:
            reader.start()
        serve_app(app, settings, sock=socks)
        return 0

    supervisor = Supervisor(
        sockets,
        main,
        run_dir=run_dir,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        where=f" on {settings.host}:{port}",
    )
    log.info("starting %d workers on %s:%d (run folder %s)", count, settings.host, port, run_dir)
    return supervisor.run()
