"""The gateway as ``specshadow serve`` builds it, plus one read-only route for its receive stamps.

``python -m bench.stamp_probe --port P --primary URL`` runs ``build_app`` with the same settings,
telemetry, loop (uvloop), switch interval and ``run_app`` flags as ``gateway.serve``, and adds an
in-memory exchange sink next to the usual ones. ``GET /bench/stamps`` answers
``{request_id: [received_ns, ...]}`` — the recorder's per-event receive times (perf_counter_ns)
of every finished primary leg, in event order.

Why a probe and not ``serve --store``: comparison records keep per-leg summaries (ttft, gaps), not
per-event stamps, and adding a debug endpoint to the product for one benchmark would be the more
invasive choice. The probe runs as its own process on the gateway's core, like every gateway arm,
so what it measures — the recorder's ``received_ns`` against the simulator's ``sent_ns`` — is the
timestamp a deployed gateway records, taken by the same code under the same scheduling.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from core import jsonx
from core.sinks import MemorySink
from gateway.serve import serve_app
from gateway.settings import Settings
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from specshadow.app import build_app

SINK = web.AppKey("bench_sink", MemorySink)


async def stamps(request: web.Request) -> web.Response:
    out = {
        ex.request_id: [s.received_ns for s in ex.primary.recording.stamps]
        for ex in request.app[SINK].exchanges
        if ex.primary.recording is not None
    }
    return web.Response(body=jsonx.dumps(out), content_type="application/json")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.stamp_probe", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--primary", required=True)
    args = p.parse_args()
    settings = Settings.from_env(host=args.host, port=args.port, primary_url=args.primary)
    sink = MemorySink()
    app = build_app(settings, sinks=[sink], telemetry=build_telemetry(TelemetrySettings.from_env()))
    app[SINK] = sink
    app.router.add_get("/bench/stamps", stamps)
    serve_app(app, settings)


if __name__ == "__main__":
    main()
