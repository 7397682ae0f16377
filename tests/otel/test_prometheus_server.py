"""A real Prometheus scrapes an app serving Telemetry.render_prometheus(); PromQL sees the histograms."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from tests.otel.exchanges import make_exchange
from tests.receivers.prometheus import PrometheusServer, promtool_check_metrics, requires_prometheus

pytestmark = [pytest.mark.prometheus, requires_prometheus]

TTFT_P50_BY_ROLE = (
    "histogram_quantile(0.5, sum by (le, specshadow_leg_role) "
    "(rate(gen_ai_client_operation_time_to_first_chunk_seconds_bucket[1m])))"
)


async def test_prometheus_scrapes_metrics_and_answers_ttft_quantile_by_role(
    aiohttp_server: Callable[..., Any], prometheus_server: Callable[..., PrometheusServer]
) -> None:
    telemetry = build_telemetry(TelemetrySettings())

    async def metrics(_request: web.Request) -> web.Response:
        body, content_type = telemetry.render_prometheus()
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app)
    prometheus = prometheus_server([f"127.0.0.1:{server.port}"])

    async def keep_recording() -> None:
        while True:
            telemetry.record_exchange_metrics(make_exchange())
            await asyncio.sleep(0.2)

    recorder = asyncio.ensure_future(keep_recording())
    try:
        await prometheus.wait_ready()
        results = await prometheus.wait_for_number(TTFT_P50_BY_ROLE, timeout_s=45)
        by_role = {labels["specshadow_leg_role"]: value for labels, value in results}
        assert set(by_role) == {"primary", "candidate", "baseline"}
        # every observation is 20 ms: the median lies in the (15 ms, 20 ms] bucket
        assert all(0.015 <= v <= 0.02 for v in by_role.values()), by_role
        up = await prometheus.query('up{job="specshadow"}')
        assert [float(r["value"][1]) for r in up] == [1.0]
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{server.port}/metrics") as resp,
        ):
            passed, output = promtool_check_metrics(await resp.read())
        assert passed, output
    finally:
        recorder.cancel()
        await asyncio.gather(recorder, return_exceptions=True)
        assert telemetry.shutdown(5.0)
