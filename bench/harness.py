"""Benchmark plumbing: the process fleet, a stamped-SSE streaming client, analysis and tables.

Every arm of a benchmark is a real process on 127.0.0.1 (``specshadow simulate`` upstreams,
``specshadow serve`` gateways), started in parallel, waited for, and always killed — process
groups, a parent-death signal, and an ``atexit`` net behind the ``with Fleet()`` block.

The client records only ``(perf_counter_ns, bytes)`` per network read while a request is in
flight; everything else (SSE splitting, parsing, ttft, gaps, coalescing) is done afterwards by pure
functions, so measuring adds as little as possible to what is measured. The simulator stamps every
SSE event with a ``: sent_ns=<perf_counter_ns>`` comment just before its write; perf_counter_ns is
CLOCK_MONOTONIC on Linux, shared by all processes of the machine, so ``recv_ns - sent_ns`` is the
event's delivery latency from the upstream's write to the client's read.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import itertools
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from core import jsonx
from core.stats import percentiles

# Pinning (when the machine has ≥ 2 cores): the gateway gets a core to itself; the upstreams and
# the load-generating client share the other, in every arm alike.
GATEWAY_CPU = 0
UPSTREAM_CPU = 1
CLIENT_CPU = 1

COALESCE_NS = 5_000_000  # two output events sent ≥ 5 ms apart must not arrive in one read
STALL_NS = 10_000_000  # an event delivered > 10 ms after its upstream write is stalled

REPO_ROOT = Path(__file__).resolve().parents[1]
_URL_LINE = re.compile(rb" on (http://[0-9.]+:\d+)")


class StartupError(RuntimeError):
    """A benchmark process exited or never became ready; the message carries its log tail."""


# --------------------------------------------------------------------------- processes


def specshadow_argv() -> list[str]:
    """The ``specshadow`` console script next to this interpreter, else ``python -m specshadow``."""
    script = Path(sys.executable).with_name("specshadow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specshadow"]


def can_pin() -> bool:
    return (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None


def pin_self(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})


def free_port() -> int:
    """A port that was free a moment ago (the gateway retries once if it was taken meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> list[str]:
    """A prefix that SIGKILLs the child if the benchmark dies without cleaning up.

    util-linux ``setpriv --pdeathsig`` rather than a ``preexec_fn`` calling prctl: preexec_fn is
    unsafe once threads exist (aiohttp's resolver uses a thread pool).
    """
    return ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []


class Fleet:
    """Owns every child process of one benchmark run; ``stop()`` is idempotent and always runs."""

    def __init__(self, *, pin: bool, grace_s: float = 5.0) -> None:
        self.pin = pin and can_pin()
        self.grace_s = grace_s
        self.log_dir = Path(tempfile.mkdtemp(prefix="specshadow-bench-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_s: dict[str, float] = {}  # name → seconds from SIGTERM to exit
        self.killed: list[str] = []  # names that needed SIGKILL
        atexit.register(self.stop)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        cpu: int | None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        prefix = ["taskset", "-c", str(cpu)] if self.pin and cpu is not None else []
        argv = [*_die_with_parent(), *prefix, *argv]
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                env={**os.environ, **env} if env else None,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: one killpg ends it all
            )
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _check_alive(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            raise StartupError(
                f"{name} exited with {proc.returncode}; log tail:\n{self.log_tail(name)}"
            )

    async def simulator(self, name: str, args: Sequence[str], *, timeout_s: float = 60.0) -> str:
        """Start ``specshadow simulate --port 0 …``; return the base URL it prints."""
        simulate = ["simulate", "--host", "127.0.0.1", "--port", "0", *args]
        proc = self._spawn(
            name, [*specshadow_argv(), "--log-level", "WARNING", *simulate], UPSTREAM_CPU
        )
        log = self.log_dir / f"{name}.log"
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            match = _URL_LINE.search(log.read_bytes())
            if match:
                return match.group(1).decode()
            self._check_alive(name, proc)
            await asyncio.sleep(0.05)
        raise StartupError(f"{name} printed no URL within {timeout_s} s:\n{self.log_tail(name)}")

    async def gateway(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> str:
        """Start ``specshadow serve`` on a free port; return its base URL once /healthz answers.

        ``env`` is added to this process's environment (e.g. ``SPECSHADOW_TELEMETRY=off``).
        """
        serve = [*specshadow_argv(), "--log-level", "WARNING", "serve", "--host", "127.0.0.1"]
        argv_for = lambda port: [*serve, "--port", str(port), *args]  # noqa: E731
        return await self.http_server(name, argv_for, env=env, timeout_s=timeout_s)

    async def relay(self, name: str, upstream: str, *, timeout_s: float = 60.0) -> str:
        """Start ``bench.raw_relay`` (the floor for a Python proxy) on the gateway's core."""
        relay = [sys.executable, "-m", "bench.raw_relay", "--upstream", upstream]
        argv_for = lambda port: [*relay, "--port", str(port)]  # noqa: E731
        return await self.http_server(name, argv_for, timeout_s=timeout_s)

    async def http_server(
        self,
        name: str,
        argv_for: Callable[[int], list[str]],
        *,
        env: Mapping[str, str] | None = None,
        health_path: str = "/healthz",
        timeout_s: float = 60.0,
    ) -> str:
        """Start ``argv_for(port)`` on a free port, pinned like a gateway; wait for ``health_path``."""
        for attempt in range(2):
            port = free_port()
            proc = self._spawn(name, argv_for(port), GATEWAY_CPU, env)
            url = f"http://127.0.0.1:{port}"
            try:
                await _wait_healthy(url + health_path, timeout_s, self._check_alive, name, proc)
            except StartupError:
                if attempt == 0 and b"address already in use" in self._log_bytes(name).lower():
                    continue  # the free port was taken between our probe and its bind
                raise
            return url
        raise AssertionError("unreachable")

    def _log_bytes(self, name: str) -> bytes:
        path = self.log_dir / f"{name}.log"
        return path.read_bytes() if path.exists() else b""

    def stop(self) -> None:
        """SIGTERM every process group, wait ``grace_s``, SIGKILL what is left."""
        started = time.perf_counter()
        live = {n: p for n, p in self.procs.items() if n not in self.stop_s}
        for proc in live.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for name, proc in live.items():
            remaining = max(0.0, started + self.grace_s - time.perf_counter())
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                self.killed.append(name)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self.stop_s[name] = time.perf_counter() - started


async def _wait_healthy(
    url: str,
    timeout_s: float,
    check_alive: Callable[[str, subprocess.Popen[bytes]], None],
    name: str,
    proc: subprocess.Popen[bytes],
) -> None:
    deadline = time.perf_counter() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.perf_counter() < deadline:
            check_alive(name, proc)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise StartupError(f"{url} not healthy within {timeout_s} s")


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return jsonx.loads(await resp.read())


def simulator_args(
    *, mode: str, prefill_ms: float, step_ms: float, tokens: int, fault: str | None = None
) -> list[str]:
    """Every request gets exactly ``tokens`` output tokens, so every arm does the same work."""
    args = ["--mode", mode, "--prefill-ms", str(prefill_ms), "--step-ms", str(step_ms)]
    args += ["--min-output-tokens", str(tokens), "--max-output-tokens", str(tokens)]
    return [*args, "--fault", fault] if fault else args


# --------------------------------------------------------------------------- the client


@dataclass(frozen=True, slots=True)
class Read:
    """One network read: when ``readany()`` returned, and what it returned."""

    recv_ns: int
    data: bytes


@dataclass(frozen=True, slots=True)
class StreamResult:
    """One streamed request as the client saw it (raw; see :func:`analyze`)."""

    arm: str
    index: int
    warmup: bool
    t_send_ns: int  # just before the request is handed to aiohttp
    end_ns: int
    status: int | None
    error: str | None
    reads: tuple[Read, ...]


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    url: str  # the full POST endpoint
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers (e.g. a proxy's key)


def chat_body(index: int, max_tokens: int) -> bytes:
    """Request ``index`` is identical in every arm (same prompt → same simulated text)."""
    return jsonx.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": f"benchmark prompt number {index}"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )


async def stream_request(
    session: aiohttp.ClientSession,
    arm: Arm,
    index: int,
    body: bytes,
    *,
    warmup: bool,
    timeout_s: float,
) -> StreamResult:
    reads: list[Read] = []
    status: int | None = None
    error: str | None = None
    perf_ns = time.perf_counter_ns
    headers = {"content-type": "application/json", "x-request-id": f"{arm.name}-{index}"}
    headers.update(arm.headers)
    t_send_ns = perf_ns()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(arm.url, data=body, headers=headers) as resp:
                status = resp.status
                content = resp.content
                while chunk := await content.readany():
                    reads.append(Read(perf_ns(), chunk))
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = type(exc).__name__
    return StreamResult(arm.name, index, warmup, t_send_ns, perf_ns(), status, error, tuple(reads))


async def run_interleaved(
    arms: Sequence[Arm],
    *,
    requests: int,
    warmup: int,
    concurrency: int,
    body_for: Callable[[int], bytes],
    timeout_s: float = 60.0,
    stagger_s: float = 0.0,
) -> list[StreamResult]:
    """Request ``i`` goes to every arm before request ``i + 1`` goes to any; the arm that goes
    first rotates with ``i``, so slow drifts of the machine fall on every arm alike.

    ``stagger_s``: worker ``k`` of ``concurrency`` starts ``k × stagger_s / concurrency`` late, so
    equal-length streams do not start (and then end and restart) all at once.
    """
    jobs: deque[tuple[Arm, int]] = deque()
    for i in range(warmup + requests):
        shift = i % len(arms)
        jobs.extend((arm, i) for arm in [*arms[shift:], *arms[:shift]])
    results: list[StreamResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:

        async def worker(k: int) -> None:
            if stagger_s:
                await asyncio.sleep(k * stagger_s / concurrency)
            while jobs:
                arm, i = jobs.popleft()
                body = body_for(i)
                res = await stream_request(
                    session, arm, i, body, warmup=i < warmup, timeout_s=timeout_s
                )
                results.append(res)

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return results


# --------------------------------------------------------------------------- analysis (pure)


@dataclass(frozen=True, slots=True)
class Event:
    """One SSE event, stamped with the read that completed it."""

    read_index: int
    recv_ns: int
    sent_ns: int | None  # from the ``: sent_ns=`` comment, if the upstream stamped it
    output: bool  # carries generated output (content, reasoning, text or tool-call delta)
    done: bool  # ``data: [DONE]``
    text: str


def _is_output(choice: dict[str, Any]) -> tuple[bool, str]:
    delta = choice.get("delta")
    delta = delta if isinstance(delta, dict) else {}
    text = delta.get("content") or choice.get("text") or ""
    other = delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls")
    return bool(text or other), text if isinstance(text, str) else ""


def parse_event(raw: bytes, recv_ns: int, read_index: int) -> Event:
    sent_ns: int | None = None
    data: list[bytes] = []
    for line in raw.splitlines():
        if line.startswith(b": sent_ns="):
            with contextlib.suppress(ValueError):
                sent_ns = int(line[10:])
        elif line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
    payload = b"\n".join(data)
    if payload == b"[DONE]":
        return Event(read_index, recv_ns, sent_ns, output=False, done=True, text="")
    try:
        obj = jsonx.loads(payload) if payload else None
    except jsonx.JSONDecodeError:
        obj = None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    output, text = False, ""
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            is_out, piece = _is_output(choice)
            output, text = output or is_out, text + piece
    return Event(read_index, recv_ns, sent_ns, output=output, done=False, text=text)


def split_events(reads: Sequence[Read]) -> list[Event]:
    """Split on blank lines (LF, as the simulator and a byte-exact gateway write them)."""
    events: list[Event] = []
    buf = b""
    for n, read in enumerate(reads):
        *complete, buf = (buf + read.data).replace(b"\r\n", b"\n").split(b"\n\n")
        events.extend(parse_event(raw, read.recv_ns, n) for raw in complete if raw.strip())
    return events


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Client-side timings of one request (all ``_ns`` are durations)."""

    arm: str
    index: int
    error: str | None  # None when status 200, [DONE] seen and ≥ 1 output event
    ttft_ns: int | None  # t_send → read holding the first output event
    e2e_ns: int | None  # t_send → read holding the last output event
    chunk_gaps_ns: tuple[int, ...]  # between consecutive output events' reads
    sent_gaps_ns: tuple[int, ...]  # the same gaps at the upstream (sent_ns): its own pacing
    delivery_ns: tuple[int, ...]  # per stamped event: recv_ns - sent_ns
    output_events: int
    reads: int
    coalesced: int  # output events sharing a read with one sent ≥ COALESCE_NS earlier
    stalled: int  # stamped events with delivery > STALL_NS
    text: str


def analyze(result: StreamResult) -> RequestMetrics:
    events = split_events(result.reads)
    outputs = [e for e in events if e.output]
    t0 = result.t_send_ns
    delivery = tuple(e.recv_ns - e.sent_ns for e in events if e.sent_ns is not None)
    first_sent: dict[int, int] = {}
    coalesced = 0
    for e in outputs:
        if e.sent_ns is None:
            continue
        earliest = first_sent.setdefault(e.read_index, e.sent_ns)
        coalesced += e.sent_ns - earliest >= COALESCE_NS
    error = result.error
    if error is None and result.status != 200:
        error = f"status {result.status}"
    elif error is None and not any(e.done for e in events):
        error = "no [DONE]"
    elif error is None and not outputs:
        error = "no output"
    return RequestMetrics(
        arm=result.arm,
        index=result.index,
        error=error,
        ttft_ns=outputs[0].recv_ns - t0 if outputs else None,
        e2e_ns=outputs[-1].recv_ns - t0 if outputs else None,
        chunk_gaps_ns=tuple(b.recv_ns - a.recv_ns for a, b in itertools.pairwise(outputs)),
        sent_gaps_ns=tuple(
            b.sent_ns - a.sent_ns
            for a, b in itertools.pairwise(outputs)
            if a.sent_ns is not None and b.sent_ns is not None
        ),
        delivery_ns=delivery,
        output_events=len(outputs),
        reads=len(result.reads),
        coalesced=coalesced,
        stalled=sum(d > STALL_NS for d in delivery),
        text="".join(e.text for e in outputs),
    )


@dataclass(frozen=True, slots=True)
class Dist:
    """A distribution in milliseconds (``None`` when there were no samples)."""

    n: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None


def dist_ms(values_ns: Iterable[int]) -> Dist:
    ms = [v / 1e6 for v in values_ns]
    p50, p90, p99, p100 = percentiles(ms, (50, 90, 99, 100))
    return Dist(len(ms), p50, p90, p99, p100)


@dataclass(frozen=True, slots=True)
class ArmSummary:
    arm: str
    requests: int
    errors: int
    ttft: Dist
    chunk_gap: Dist
    e2e: Dist
    delivery: Dist
    upstream_gap: Dist
    output_events: int
    reads: int
    coalesced: int
    stalled: int


def summarize(arm: str, metrics: Sequence[RequestMetrics]) -> ArmSummary:
    ok = [m for m in metrics if m.error is None]
    return ArmSummary(
        arm=arm,
        requests=len(metrics),
        errors=len(metrics) - len(ok),
        ttft=dist_ms(m.ttft_ns for m in ok if m.ttft_ns is not None),
        chunk_gap=dist_ms(g for m in ok for g in m.chunk_gaps_ns),
        e2e=dist_ms(m.e2e_ns for m in ok if m.e2e_ns is not None),
        delivery=dist_ms(d for m in metrics for d in m.delivery_ns),
        upstream_gap=dist_ms(g for m in ok for g in m.sent_gaps_ns),
        output_events=sum(m.output_events for m in metrics),
        reads=sum(m.reads for m in metrics),
        coalesced=sum(m.coalesced for m in metrics),
        stalled=sum(m.stalled for m in metrics),
    )


def by_arm(results: Iterable[StreamResult], arms: Sequence[Arm]) -> dict[str, list[RequestMetrics]]:
    """Measured (non-warm-up) requests per arm, arms in the given order, requests by index."""
    out: dict[str, list[RequestMetrics]] = {arm.name: [] for arm in arms}
    for r in sorted(results, key=lambda r: r.index):
        if not r.warmup:
            out[r.arm].append(analyze(r))
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


# --------------------------------------------------------------------------- reporting


@dataclass(frozen=True, slots=True)
class Check:
    """A target: passes when ``value`` is known and ``value <= limit`` (``>=`` with ``at_least``)."""

    name: str
    value: float | int | None  # int for counts
    limit: float
    unit: str = "ms"
    at_least: bool = False

    @property
    def passed(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    @property
    def limit_text(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.limit:g} {self.unit}".rstrip()


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def render_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Fixed-width text; numeric columns right-aligned, text columns left-aligned."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in [list(header), *cells]) for i in range(len(header))]
    numeric = [
        all(isinstance(row[i], int | float) or row[i] in (None, "") for row in rows)
        for i in range(len(header))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    rule = "-" * max(len(line(list(header))), len(title))
    return "\n".join([title, rule, line(list(header)), rule, *map(line, cells), rule])


def render_checks(checks: Sequence[Check]) -> str:
    rows = [(c.name, c.value, c.limit_text, "PASS" if c.passed else "FAIL") for c in checks]
    return render_table("Targets", ("target", "measured", "limit", "verdict"), rows)


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "affinity_client": sorted(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": os.getloadavg(),
    }


def pinning_line(pinned: bool) -> str:
    if not pinned:
        return "pinning: off (all processes float over all CPUs)"
    return (
        f"pinning (taskset): gateways → CPU {GATEWAY_CPU}; "
        f"upstream simulators → CPU {UPSTREAM_CPU}; client (this process) → CPU {CLIENT_CPU}"
    )


def load_line(label: str) -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average at {label}: {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min, {os.cpu_count()} CPUs)"


def write_json(path: str, obj: Any) -> None:
    Path(path).write_bytes(jsonx.dumps(obj, indent=True) + b"\n")


def add_common_args(p: argparse.ArgumentParser, *, requests: int) -> None:
    p.add_argument("--requests", type=int, default=requests, help="measured requests per arm")
    p.add_argument("--warmup", type=int, default=5, help="warm-up requests per arm (discarded)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--step-ms", type=float, default=20.0, help="upstream pacing between tokens")
    p.add_argument("--prefill-ms", type=float, default=2.0, help="upstream time to first token")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request client timeout")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--json", metavar="FILE", help="also write every number to FILE")


def run_main(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``main`` on uvloop; SIGTERM becomes SystemExit so the fleet is always stopped."""

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            return runner.run(main())
        except StartupError as exc:
            print(f"benchmark setup failed: {exc}", file=sys.stderr)
            return 2
