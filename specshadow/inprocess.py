"""An in-process gateway in front of running vLLM servers, for tests, the agreement script and demos.

Owns nothing on the request path: it only builds an embedded policy (:func:`shadow_policy`) and
runs :func:`specshadow.app.build_app` on a loopback port with a :class:`~core.sinks.MemorySink`
(:func:`running_gateway`), the same way ``specshadow serve`` would but inside the caller's event
loop, so a test can read the exchanges and the records store right after its traffic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from core.sinks import MemorySink
from gateway.settings import Settings
from policies.compile import parse_policy
from policies.store import PolicyStore
from specshadow.app import build_app


@dataclass(frozen=True, slots=True)
class InProcessGateway:
    url: str  # base URL without /v1
    sink: MemorySink
    store_path: Path | None

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"


def shadow_policy(
    primary_url: str,
    *,
    candidate_url: str | None = None,
    baseline_url: str | None = None,
    ratio: float = 1.0,
    shaping: Mapping[str, Any] | None = None,
    capture: str | bool = False,
) -> PolicyStore:
    """Primary plus an optional candidate and baseline, all ``kind: vllm``, mirrored at ``ratio``.

    The candidate's ``/metrics`` is scraped for the records' backend window. ``shaping`` is the
    policy's ``shaping`` block (e.g. ``{"override_temperature": 1.5}`` for a deliberately
    different candidate); ``capture`` its text capture (``full`` keeps output text in records).
    """
    backends: dict[str, Any] = {"primary": {"url": primary_url, "kind": "vllm"}}
    legs: list[dict[str, str]] = []
    if candidate_url is not None:
        backends["candidate"] = {
            "url": candidate_url,
            "kind": "vllm",
            "metrics_url": f"{candidate_url}/metrics",
        }
        legs.append({"backend": "candidate", "role": "candidate"})
    if baseline_url is not None:
        backends["baseline"] = {"url": baseline_url, "kind": "vllm"}
        legs.append({"backend": "baseline", "role": "baseline"})
    raw: dict[str, Any] = {
        "version": 1,
        "backends": backends,
        "primary": "primary",
        "default": {"ratio": ratio, "legs": legs},
        "capture": {"text": capture},
        "shaping": dict(shaping or {}),
    }
    return PolicyStore(parse_policy(raw, source="backends (embedded)"))


@asynccontextmanager
async def running_gateway(
    policy: PolicyStore,
    *,
    store_path: Path | None = None,
    scrape_interval_s: float = 2.0,
    shutdown_timeout_s: float = 2.0,
) -> AsyncIterator[InProcessGateway]:
    """The gateway on ``127.0.0.1:<free port>``; on exit records flush.

    Callers wait for their exchanges (``sink.wait_for``) before leaving the block: shutdown gives
    in-flight legs only ``shutdown_timeout_s``.
    """
    sink = MemorySink()
    settings = Settings(
        primary_url=None,
        store_path=str(store_path) if store_path is not None else None,
        scrape_interval_s=scrape_interval_s,
        shutdown_timeout_s=shutdown_timeout_s,
    )
    runner = web.AppRunner(
        build_app(settings, sinks=[sink], policy=policy), handler_cancellation=True, access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield InProcessGateway(url=f"http://127.0.0.1:{port}", sink=sink, store_path=store_path)
    finally:
        await runner.cleanup()
