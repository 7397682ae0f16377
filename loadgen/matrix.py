"""Benchmark matrix: output-length bucket × concurrency × backend configuration, one results table.

A matrix file (YAML, strict: unknown keys are errors) names the backends — each an already running
endpoint (``base_url``) or started per configuration through a ``command`` template with a
readiness URL (``{port}`` is replaced by a free port) — the output-length buckets (name →
``max_tokens``), the concurrencies and the trace. Each backend is started once, swept over every
bucket × concurrency cell with :func:`loadgen.runner.run_schedule`, and stopped.

The results table (JSONL, one line per cell, ``schema = specshadow.matrix/1``) carries the cell's
percentiles and throughput and, for every backend except the reference, the paired speedup
(reference/candidate, same trace rows, bootstrap 95 % CI; :mod:`loadgen.speedup`) and ``stable``:
the speedup's CI stays above 1 in this cell and in its neighbouring concurrencies — the stable
operating region, rather than one best number. ``specshadow report --results`` reads it.

Example::

    trace: healthbench_chat.jsonl   # relative to this file; default: the bundled trace
    requests: 40                 # measured requests per cell
    warmup: 2
    model: tiny-llama            # optional model override
    reference: plain             # default: the first backend
    buckets: {short: 32, long: 128}
    concurrency: [1, 4, 16]
    slo: {ttft_s: 0.5, tpot_s: 0.05}
    backends:
      - {name: plain, proposer: none, base_url: "http://127.0.0.1:8000/v1"}
      - name: ngram-k4
        proposer: ngram
        depth: 4
        command: "specshadow simulate --port {port} --mode speculative --k 4"
        ready_url: "http://127.0.0.1:{port}/health"
        base_url: "http://127.0.0.1:{port}/v1"

Size: the matrix runner is one pipeline (spec → cells → processes → results → stable regions); its
parts are small and only meaningful together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core import jsonx
from core.procs import ChildProcess, ProcessError, free_port, wait_http_ready_async
from core.stats import mean, percentiles
from loadgen.client import RequestResult, RequestSettings
from loadgen.progress import Progress
from loadgen.results import meets_slos
from loadgen.runner import run_schedule
from loadgen.schedule import ScheduleSpec
from loadgen.speedup import paired_speedup
from loadgen.trace import TraceRecord

__all__ = [
    "BackendConfig",
    "MatrixConfig",
    "MatrixError",
    "MatrixRow",
    "load_matrix",
    "mark_stable",
    "run_matrix",
    "stable_regions",
]

log = logging.getLogger(__name__)

Proposer = Literal["none", "draft_model", "ngram", "suffix", "eagle", "eagle3", "mtp", "other"]
SCHEMA = "specshadow.matrix/1"
CELL_METRICS = ("ttft_s", "tpot_s", "e2e_s", "chunk_gap_p50_s", "chunk_gap_p99_s")
_KV_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class MatrixError(ValueError):
    """A matrix file that cannot run (names the field)."""


class BackendConfig(BaseModel):
    """One backend configuration: an endpoint, optionally started from a command template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    proposer: Proposer = "none"
    depth: int = Field(default=0, ge=0, description="num_speculative_tokens (0: no speculation)")
    base_url: str = Field(description="OpenAI base URL, e.g. http://127.0.0.1:{port}/v1")
    command: str | None = Field(default=None, description="shell-free command template")
    ready_url: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535, description="default: a free port")
    ready_timeout_s: float = Field(default=180.0, gt=0)
    metrics_url: str | None = Field(default=None, description="Prometheus /metrics to sample")
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ready_needs_command(self) -> BackendConfig:
        if self.ready_url is not None and self.command is None:
            raise ValueError("ready_url needs a command")
        return self


class MatrixConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    trace: str | None = None
    requests: int = Field(default=32, ge=1)
    warmup: int = Field(default=0, ge=0)
    model: str | None = None
    stream: bool = True
    reference: str | None = None
    buckets: dict[str, int] = Field(min_length=1)
    concurrency: list[int] = Field(min_length=1)
    slo: dict[str, float] = Field(default_factory=dict)
    backends: list[BackendConfig] = Field(min_length=1)
    out: str | None = None
    request_timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> MatrixConfig:
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError("backends: names must be unique")
        if self.reference is not None and self.reference not in names:
            raise ValueError(f"reference: {self.reference!r} is not a backend name")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency: values must be >= 1")
        if any(v < 1 for v in self.buckets.values()):
            raise ValueError("buckets: max_tokens must be >= 1")
        return self

    @property
    def reference_name(self) -> str:
        return self.reference or self.backends[0].name


def load_matrix(path: str | Path) -> MatrixConfig:
    """Parse and validate a matrix file; :class:`MatrixError` names the field."""
    try:
        raw = yaml.safe_load(Path(path).read_text("utf-8"))
        return MatrixConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(file)"
        raise MatrixError(f"{path}: {where}: {first['msg']}") from exc
    except (yaml.YAMLError, OSError) as exc:
        raise MatrixError(f"{path}: {exc}") from exc


# -- pure: cells, pairing, stable region ----------------------------------------------------------


def cell_row(
    backend: BackendConfig,
    bucket: str,
    max_tokens: int,
    concurrency: int,
    results: Sequence[RequestResult],
    wall_s: float,
    slos: Mapping[str, float],
) -> dict[str, Any]:
    """One cell of the results table (speedup fields are filled in later by :func:`pair_cells`)."""
    measured = [r for r in results if not r.warmup]
    ok = [r for r in measured if r.ok]
    row: dict[str, Any] = {
        "schema": SCHEMA,
        "backend": backend.name,
        "proposer": backend.proposer,
        "depth": backend.depth,
        "bucket": bucket,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "requests": len(measured),
        "succeeded": len(ok),
        "failed": len(measured) - len(ok),
        "wall_s": wall_s,
    }
    for m in CELL_METRICS:
        values = [v for r in ok if (v := getattr(r, m)) is not None]
        p50, p95, p99 = percentiles(values, (50.0, 95.0, 99.0))
        row |= {f"{m}_p50": p50, f"{m}_p95": p95, f"{m}_p99": p99}
    tpe = [r.tokens_per_event for r in ok if r.tokens_per_event is not None]
    row["tokens_per_event_mean"] = mean(tpe)
    row["tokens_per_event_p50"] = percentiles(tpe, (50.0,))[0]
    tokens = [r.output_tokens or 0 for r in ok]
    row["output_tokens_mean"] = mean([float(t) for t in tokens])
    row["throughput_rps"] = len(ok) / wall_s if wall_s > 0 else None
    row["output_tokens_per_s"] = sum(tokens) / wall_s if wall_s > 0 else None
    good = sum(1 for r in measured if meets_slos(r.to_json(), slos))
    row["goodput_share"] = good / len(measured) if measured else None
    return row


def pair_cells(
    rows: list[dict[str, Any]],
    per_request: Mapping[tuple[str, str, int], Sequence[RequestResult]],
    reference: str,
) -> None:
    """Add paired speedups (reference/backend, matched by trace row) to every non-reference row."""
    for row in rows:
        row["reference"] = reference
        key = (row["backend"], row["bucket"], row["concurrency"])
        ref_key = (reference, row["bucket"], row["concurrency"])
        for metric in ("e2e_s", "tpot_s", "ttft_s"):
            name = "speedup_" + metric.removesuffix("_s")
            row[name] = row[f"{name}_ci_low"] = row[f"{name}_ci_high"] = None
        row["paired_n"] = None
        if row["backend"] == reference or ref_key not in per_request:
            continue
        ref = {r.record_index: r for r in per_request[ref_key] if r.ok and not r.warmup}
        mine = [r for r in per_request[key] if r.ok and not r.warmup and r.record_index in ref]
        for metric in ("e2e_s", "tpot_s", "ttft_s"):
            pairs = [(getattr(ref[r.record_index], metric), getattr(r, metric)) for r in mine]
            s = paired_speedup(pairs)
            if s is not None:
                name = "speedup_" + metric.removesuffix("_s")
                row[name], row[f"{name}_ci_low"], row[f"{name}_ci_high"] = (
                    s.point,
                    s.ci_low,
                    s.ci_high,
                )
                if metric == "e2e_s":
                    row["paired_n"] = s.n


def _opt_float(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _opt_int(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass(frozen=True, slots=True)
class MatrixRow:
    """One cell of the results table as its readers read it: the row :func:`cell_row` writes,
    :func:`pair_cells` and :func:`mark_stable` complete, and :meth:`from_json` reads back (the
    JSONL's format is the dict's; this is its typed reading)."""

    backend: str | None
    proposer: str | None
    depth: int | None
    bucket: str | None
    max_tokens: int | None
    concurrency: int | None
    requests: int | None
    succeeded: int | None
    ttft_s_p50: float | None
    tpot_s_p50: float | None
    e2e_s_p99: float | None
    tokens_per_event_mean: float | None
    goodput_share: float | None
    kv_cache_usage_peak: float | None
    reference: str | None
    speedup_e2e: float | None
    speedup_e2e_ci_low: float | None
    speedup_e2e_ci_high: float | None
    stable: bool | None

    @staticmethod
    def is_matrix(row: Mapping[str, Any]) -> bool:
        """Whether a result row is a matrix cell (``schema specshadow.matrix/…``)."""
        return str(row.get("schema", "")).startswith("specshadow.matrix/")

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> MatrixRow:
        def text(key: str) -> str | None:
            v = row.get(key)
            return None if v is None else str(v)

        stable = row.get("stable")
        return cls(
            backend=text("backend"),
            proposer=text("proposer"),
            depth=_opt_int(row.get("depth")),
            bucket=text("bucket"),
            max_tokens=_opt_int(row.get("max_tokens")),
            concurrency=_opt_int(row.get("concurrency")),
            requests=_opt_int(row.get("requests")),
            succeeded=_opt_int(row.get("succeeded")),
            ttft_s_p50=_opt_float(row.get("ttft_s_p50")),
            tpot_s_p50=_opt_float(row.get("tpot_s_p50")),
            e2e_s_p99=_opt_float(row.get("e2e_s_p99")),
            tokens_per_event_mean=_opt_float(row.get("tokens_per_event_mean")),
            goodput_share=_opt_float(row.get("goodput_share")),
            kv_cache_usage_peak=_opt_float(row.get("kv_cache_usage_peak")),
            reference=text("reference"),
            speedup_e2e=_opt_float(row.get("speedup_e2e")),
            speedup_e2e_ci_low=_opt_float(row.get("speedup_e2e_ci_low")),
            speedup_e2e_ci_high=_opt_float(row.get("speedup_e2e_ci_high")),
            stable=None if stable is None else bool(stable),
        )


def mark_stable(rows: list[dict[str, Any]], metric: str = "speedup_e2e") -> None:
    """``stable``: this cell's CI is above 1 and so is every neighbouring concurrency's (same
    backend and bucket); ``None`` for the reference."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["backend"], row["bucket"]), []).append(row)
    for group in groups.values():
        group.sort(key=lambda r: r["concurrency"])
        above = [(r.get(f"{metric}_ci_low") or 0.0) > 1.0 for r in group]
        for i, row in enumerate(group):
            if row["backend"] == row.get("reference"):
                row["stable"] = None
                continue
            neighbours = above[max(0, i - 1) : i + 2]
            row["stable"] = all(neighbours)


def stable_regions(rows: Sequence[Mapping[str, Any] | MatrixRow]) -> list[str]:
    """Human lines: per backend × bucket, the concurrencies of the stable operating region."""
    groups: dict[tuple[str, str], list[int]] = {}
    for raw in rows:
        row = raw if isinstance(raw, MatrixRow) else MatrixRow.from_json(raw)
        if row.stable and row.concurrency is not None:
            groups.setdefault((str(row.backend), str(row.bucket)), []).append(row.concurrency)
    lines = []
    for (backend, bucket), concs in sorted(groups.items()):
        concs.sort()
        span = f"{concs[0]}" if len(concs) == 1 else f"{concs[0]}–{concs[-1]}"
        lines.append(f"{backend} × {bucket}: speedup CI > 1 at concurrency {span}")
    return lines


# -- I/O: backends and the sweep ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiveBackend:
    config: BackendConfig
    base_url: str
    metrics_url: str | None


@contextlib.asynccontextmanager
async def started_backend(config: BackendConfig) -> AsyncIterator[LiveBackend]:
    """The backend for the ``async with`` body: started from its command (a
    :class:`core.procs.ChildProcess`: own process group, output in a temporary log whose tail a
    startup failure shows, the whole group stopped on exit) or used as it is."""
    port = config.port or free_port()

    def fill(template: str | None) -> str | None:
        return None if template is None else template.replace("{port}", str(port))

    base_url, metrics_url = fill(config.base_url), fill(config.metrics_url)
    assert base_url is not None
    if config.command is None:
        yield LiveBackend(config, base_url, metrics_url)
        return
    argv = shlex.split(fill(config.command) or "")
    if argv and argv[0] == "specshadow":  # run the CLI of this very installation
        argv = [sys.executable, "-m", "specshadow", *argv[1:]]
    log.info("starting backend %s: %s", config.name, shlex.join(argv))
    with tempfile.TemporaryDirectory(prefix="specshadow-matrix-") as log_dir:
        proc = ChildProcess(
            argv,
            name=f"backend {config.name}",
            log_path=Path(log_dir) / "backend.log",
            env={**os.environ, **config.env},
        )
        try:
            ready = fill(config.ready_url) or base_url.rstrip("/") + "/models"
            try:
                await wait_http_ready_async(
                    ready, proc, config.ready_timeout_s, interval_s=0.1, request_timeout_s=5.0
                )
            except ProcessError as exc:
                raise MatrixError(str(exc)) from None
            yield LiveBackend(config, base_url, metrics_url)
        finally:
            await asyncio.to_thread(proc.stop, 20.0)


_GAUGE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+([-+0-9.eEnaNIif]+)\s*$", re.M)


def parse_kv_usage(text: str) -> float | None:
    """The largest KV-cache usage gauge (0–1) in a Prometheus text page, if any."""
    values = [float(v) for name, v in _GAUGE.findall(text) if name in _KV_GAUGES]
    return max(values) if values else None


async def _sample_kv(url: str, peak: list[float], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url) as resp:
                    value = parse_kv_usage(await resp.text())
                    if value is not None:
                        peak.append(value)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


async def run_matrix(
    config: MatrixConfig,
    records: Sequence[TraceRecord],
    *,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Sweep every backend × bucket × concurrency; returns the results table rows."""
    rows: list[dict[str, Any]] = []
    per_request: dict[tuple[str, str, int], list[RequestResult]] = {}
    for backend in config.backends:
        async with started_backend(backend) as live:
            for bucket, max_tokens in config.buckets.items():
                for concurrency in config.concurrency:
                    row, results = await _run_cell(
                        config, live, bucket, max_tokens, concurrency, records, progress
                    )
                    per_request[(backend.name, bucket, concurrency)] = results
                    rows.append(row)
    pair_cells(rows, per_request, config.reference_name)
    mark_stable(rows)
    return rows


async def _run_cell(
    config: MatrixConfig,
    live: LiveBackend,
    bucket: str,
    max_tokens: int,
    concurrency: int,
    records: Sequence[TraceRecord],
    progress: bool,
) -> tuple[dict[str, Any], list[RequestResult]]:
    spec = ScheduleSpec(
        mode="concurrency",
        concurrency=concurrency,
        warmup=config.warmup,
        max_requests=config.requests,
    )
    settings = RequestSettings(
        base_url=live.base_url,
        stream=config.stream,
        model=config.model,
        max_tokens=max_tokens,
        request_timeout_s=config.request_timeout_s,
    )
    bar = Progress(config.requests) if progress else None
    if bar is not None:
        sys.stderr.write(f"{live.config.name} × {bucket} × c={concurrency}\n")
    peak: list[float] = []
    stop = asyncio.Event()
    sampler = None
    if live.metrics_url:
        from core.tasks import TaskSet

        sampler = TaskSet()
        _ = sampler.spawn(_sample_kv(live.metrics_url, peak, stop), name="matrix-kv-sampler")
    started = time.perf_counter()
    try:
        results = await run_schedule(records, spec, settings, progress=bar)
    finally:
        stop.set()
        if sampler is not None:
            await sampler.drain(timeout_s=3.0)
        if bar is not None:
            bar.close()
    wall_s = time.perf_counter() - started
    row = cell_row(live.config, bucket, max_tokens, concurrency, results, wall_s, config.slo)
    row["kv_cache_usage_peak"] = max(peak) if peak else None
    return row, results


def write_table(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    with open(path, "wb") as f:
        for row in rows:
            f.write(jsonx.dumps(row) + b"\n")


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = f"{'backend':<16}{'bucket':<9}{'conc':>5}{'ok':>5}{'e2e p50':>9}{'tpot p50':>9}{'tok/ev':>7}  speedup e2e (95% CI)"
    lines = [head, "-" * len(head)]
    for r in rows:
        sp = "reference" if r["backend"] == r.get("reference") else "—"
        if r.get("speedup_e2e") is not None:
            sp = f"{r['speedup_e2e']:.2f} [{r['speedup_e2e_ci_low']:.2f}, {r['speedup_e2e_ci_high']:.2f}]"
            sp += "  stable" if r.get("stable") else ""
        e2e = r["e2e_s_p50"]
        tpot = r["tpot_s_p50"]
        tpe = r["tokens_per_event_mean"]
        lines.append(
            f"{r['backend']:<16}{r['bucket']:<9}{r['concurrency']:>5}{r['succeeded']:>5}"
            f"{'—' if e2e is None else f'{e2e * 1e3:.0f}ms':>9}"
            f"{'—' if tpot is None else f'{tpot * 1e3:.1f}ms':>9}"
            f"{'—' if tpe is None else f'{tpe:.2f}':>7}  {sp}"
        )
    return "\n".join(lines)
