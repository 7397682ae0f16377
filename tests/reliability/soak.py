"""The soak engine shared by ``tests/reliability/test_soak.py`` (short, in CI) and
``scripts/soak.py`` (N minutes, with a table). Not a test module.

Mixed traffic against a gateway *subprocess*: streaming and non-streaming requests, every request
mirrored (ratio 1) to a healthy candidate and a baseline, or — by header-matched rules — to a
shadow that hangs, answers 500, resets mid-stream, sends malformed SSE, or refuses connections;
and a share of clients that leave mid-stream. Meanwhile the gateway's RSS, open descriptors
(``/proc/PID/fd``) and, via ``GET /admin/shadow``, in-flight legs and live tasks are sampled.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from simulator.app import run_simulator
from simulator.config import SimConfig, parse_faults
from tests.reliability.helpers import GatewayProcess, chat, closed_url, spawn_gateway

FAULTY_SHADOWS = {
    "hang": "hang_after=2",
    "e500": "status=500",
    "reset": "drop_after=3",
    "malformed": "malformed",
    "refused": None,  # nothing listens
}
FAULT_HEADER = "x-soak-shadow"


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float = 20.0
    # ... and at least this many requests after the warm-up, however slow the machine: the soak's
    # traffic is a count, so what it exercised does not depend on the machine's speed.
    min_requests: int = 0
    concurrency: int = 12
    sample_every_s: float = 1.0
    faulty_every: int = 3  # every Nth request goes to a faulty shadow (cycling through kinds)
    disconnect_every: int = 17  # every Nth request's client leaves after the first chunk
    max_tokens: int = 24
    idle_wait_s: float = 20.0  # after traffic: how long to wait for in-flight work to drain
    # The gateway's upstream keep-alive (SPECSHADOW_UPSTREAM_KEEPALIVE_S): idle pooled
    # connections close after this long, so a while after the drain none of the connections
    # open then may be left — one still open was never given back (a leak), whatever the pools'
    # sizes. (Pollers — the engine probe, the scraper — open new ones meanwhile: not those.)
    keepalive_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float
    requests: int
    rss_kib: int
    fds: int
    sockets: int
    in_flight: int
    primary_in_flight: int
    tasks: int
    upstream_sockets: int = 0  # TCP to a backend (primary, shadows, their tokenizers)
    inbound_sockets: int = 0  # TCP from clients (the soak's, and these samples' own)
    unix_sockets: int = 0  # the event loop's socketpairs
    other_sockets: int = 0  # none of those (nor listening): a finished connection's open fd


@dataclass
class SoakResult:
    config: SoakConfig
    samples: list[Sample] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    warm: Sample | None = None  # after the warm-up, idle
    final: Sample | None = None  # after traffic, idle
    shadow_counts: list[dict[str, Any]] = field(default_factory=list)
    stderr_tail: str = ""
    held_at_drain: int = 0  # connections to backends and from clients open after the drain
    still_open: int = 0  # of those, how many were still open 2 keep-alives (+10 s) later
    warmup_requests: int = 0  # of :attr:`requests`, the warm-up's (the rest are numbered from 0)

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    def rss_slope_kib_per_min(self) -> float | None:
        """Least-squares slope of RSS over the second half of the run (after warm-up growth)."""
        points = [(s.t_s, s.rss_kib) for s in self.samples]
        points = points[len(points) // 2 :]
        if len(points) < 3:
            return None
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_r = sum(r for _, r in points) / n
        var = sum((t - mean_t) ** 2 for t, _ in points)
        if var == 0:
            return None
        cov = sum((t - mean_t) * (r - mean_r) for t, r in points)
        return cov / var * 60.0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "outcomes": dict(self.outcomes),
            "errors": self.errors[:20],
            "rss_slope_kib_per_min": self.rss_slope_kib_per_min(),
            "warm": None if self.warm is None else asdict(self.warm),
            "final": None if self.final is None else asdict(self.final),
            "peak_rss_kib": max((s.rss_kib for s in self.samples), default=None),
            "peak_fds": max((s.fds for s in self.samples), default=None),
            "peak_tasks": max((s.tasks for s in self.samples), default=None),
            "held_at_drain": self.held_at_drain,
            "still_open": self.still_open,
            "shadow_counts": {
                f"{c['event']}:{c['backend']}" + (f":{c['reason']}" if c["reason"] else ""): c[
                    "count"
                ]
                for c in self.shadow_counts
            },
        }


def soak_policy(primary: str, candidate: str, baseline: str, faulty: dict[str, str]) -> str:
    backends = [
        f"  prim: {{url: '{primary}', kind: sim}}",
        f"  cand: {{url: '{candidate}', kind: sim}}",
        f"  base: {{url: '{baseline}', kind: sim}}",
        *(f"  f_{kind}: {{url: '{url}', kind: sim}}" for kind, url in faulty.items()),
    ]
    rules = [
        f"  - {{name: f_{kind}, match: {{headers: {{{FAULT_HEADER}: [{kind}]}}}}, ratio: 1,"
        f" legs: [{{backend: f_{kind}, role: candidate}}]}}"
        for kind in faulty
    ]
    return (
        "version: 1\n"
        "backends:\n" + "\n".join(backends) + "\nprimary: prim\n"
        "rules:\n" + "\n".join(rules) + "\n"
        "default:\n  ratio: 1\n"
        "  legs: [{backend: cand, role: candidate}, {backend: base, role: baseline}]\n"
        "timeouts: {connect_s: 1, idle_s: 1, total_s: 5}\n"
        "budgets: {max_in_flight: 256, breaker: {failures: 5, window_s: 5, cooldown_s: 1}}\n"
    )


async def _sample(
    gp: GatewayProcess, started: float, requests: int, upstream_ports: set[int]
) -> Sample:
    status = await gp.shadow_status()
    kinds = {k: len(v) for k, v in gp.sockets_by_kind(upstream_ports).items()}
    return Sample(
        t_s=round(time.monotonic() - started, 2),
        requests=requests,
        rss_kib=gp.rss_kib(),
        fds=gp.open_fds(),
        sockets=gp.sockets(),
        in_flight=int(status["in_flight"]),
        primary_in_flight=int(status.get("primary_in_flight", 0)),
        tasks=int(status.get("tasks", -1)),
        upstream_sockets=kinds["upstream"],
        inbound_sockets=kinds["inbound"],
        unix_sockets=kinds["unix"],
        other_sockets=kinds["other"],
    )


async def _one(
    session: aiohttp.ClientSession, url: str, i: int, cfg: SoakConfig, result: SoakResult
) -> None:
    stream = i % 2 == 0
    headers = {}
    if i % cfg.faulty_every == 0:
        kinds = list(FAULTY_SHADOWS)
        headers[FAULT_HEADER] = kinds[(i // cfg.faulty_every) % len(kinds)]
    leave = stream and i % cfg.disconnect_every == 0
    body = chat(stream=stream, max_tokens=cfg.max_tokens, prompt=f"soak prompt {i % 50}")
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                result.errors.append(f"request {i}: status {resp.status}")
                result.outcomes["error"] += 1
                return
            if leave:
                await resp.content.readany()
                resp.close()
                result.outcomes["client_left"] += 1
                return
            data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.errors.append(f"request {i}: {type(exc).__name__}: {exc}")
        result.outcomes["error"] += 1
        return
    ok = data.endswith(b"data: [DONE]\n\n") if stream else b'"choices"' in data
    if not ok:
        result.errors.append(f"request {i}: incomplete body ({len(data)} bytes)")
    result.outcomes["ok" if ok else "error"] += 1


async def run_soak(
    cfg: SoakConfig, workdir: Path, on_sample: Callable[[Sample], None] | None = None
) -> SoakResult:
    """Start simulators and a gateway subprocess, drive traffic for ``cfg.duration_s``, drain."""
    result = SoakResult(config=cfg)

    def sim(**config: Any) -> SimConfig:
        return SimConfig(prefill_base_s=0.002, step_s=0.001, **config)

    async with AsyncExitStack() as stack:
        primary = await stack.enter_async_context(run_simulator(sim()))
        candidate = await stack.enter_async_context(run_simulator(sim(mode="speculative")))
        baseline = await stack.enter_async_context(run_simulator(sim()))
        faulty: dict[str, str] = {}
        for kind, fault in FAULTY_SHADOWS.items():
            if fault is None:
                faulty[kind] = closed_url()
                continue
            server = await stack.enter_async_context(
                run_simulator(sim(mode="speculative", faults=parse_faults(fault)))
            )
            faulty[kind] = server.base_url
        policy = workdir / "soak-policy.yaml"
        policy.write_text(
            soak_policy(primary.base_url, candidate.base_url, baseline.base_url, faulty)
        )
        urls = [primary.base_url, candidate.base_url, baseline.base_url, *faulty.values()]
        ports = {int(url.rstrip("/").rsplit(":", 1)[1]) for url in urls}
        env = {"SPECSHADOW_UPSTREAM_KEEPALIVE_S": str(cfg.keepalive_s)}
        # Backends' /metrics are scraped (and their engine asked) on a long period here, so that
        # the pollers' connections, closed a keep-alive after each poll, are gone at the end too.
        args = ["--policy", str(policy), "--scrape-interval", "60"]
        gp = await stack.enter_async_context(spawn_gateway(args, env))
        started = time.monotonic()
        connector = aiohttp.TCPConnector(limit=cfg.concurrency * 2)
        session = aiohttp.ClientSession(connector=connector)
        stack.push_async_callback(session.close)  # closed below already; again is a no-op

        # Warm-up: every kind of request once, then idle → the reference point.
        for i in range(2 * cfg.faulty_every * len(FAULTY_SHADOWS)):
            await _one(session, gp.url, i + 1, cfg, result)  # +1: no client leaves in warm-up
        await _drain(gp, cfg.idle_wait_s)
        result.warm = await _sample(gp, started, result.requests, ports)
        warmed = result.warmup_requests = result.requests

        counter = iter(range(10**9))
        deadline = time.monotonic() + cfg.duration_s

        async def worker() -> None:
            while True:
                i = next(counter)
                if i >= cfg.min_requests and time.monotonic() >= deadline:
                    return
                await _one(session, gp.url, i, cfg, result)

        async def sampler() -> None:
            while time.monotonic() < deadline or result.requests < warmed + cfg.min_requests:
                sample = await _sample(gp, started, result.requests, ports)
                result.samples.append(sample)
                if on_sample is not None:
                    on_sample(sample)
                await asyncio.sleep(cfg.sample_every_s)

        await asyncio.gather(sampler(), *(worker() for _ in range(cfg.concurrency)))
        await session.close()  # the clients go: their connections must go with them
        await _drain(gp, cfg.idle_wait_s)
        await _settle(gp, result, ports, 2 * cfg.keepalive_s + 10.0)
        result.final = await _sample(gp, started, result.requests, ports)
        result.shadow_counts = (await gp.shadow_status())["counts"]
        if on_sample is not None:
            on_sample(result.final)
        tail = gp.stderr()
        result.stderr_tail = tail[-4000:]
    return result


async def _drain(gp: GatewayProcess, timeout_s: float) -> None:
    """Wait until no primary request or shadow leg is in flight and only the watcher task runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await gp.shadow_status()
        busy = status["in_flight"] or status.get("primary_in_flight", 0)
        if not busy and status.get("tasks", 0) <= 1:
            return
        await asyncio.sleep(0.1)


async def _settle(
    gp: GatewayProcess, result: SoakResult, ports: set[int], timeout_s: float
) -> None:
    """Wait until every connection to a backend or from a client that is open now — or finished
    by the kernel with its descriptor still open — has closed (``result.still_open``: how many
    had not, after ``timeout_s``)."""

    def connections() -> set[str]:
        kinds = gp.sockets_by_kind(ports)
        return kinds["upstream"] | kinds["inbound"] | kinds["other"]

    held = connections()
    result.held_at_drain = len(held)
    deadline = time.monotonic() + timeout_s
    while True:
        result.still_open = len(held & connections())
        if not result.still_open or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.1)


def fds_by_kind(pid: int) -> dict[str, int]:
    """Open descriptors of ``pid`` by kind (socket, pipe, anon_inode, file) — for diagnosis."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":", 1)[0] if ":" in target else "file"] += 1
    return dict(kinds)


def dumps(result: SoakResult) -> str:
    return json.dumps(result.to_json(), indent=2)
