"""Results of a load run: per-request JSONL, a machine-readable summary, goodput, a table (pure
except the two ``write_*`` functions).

Summary percentiles use :func:`core.stats.percentiles` (the project's one definition) over
measured requests that succeeded; warm-ups are excluded everywhere. Goodput (DistServe's term, as
in ``vllm bench serve --goodput``): the share and rate of measured requests that succeeded AND met
every SLO given, e.g. ``ttft_s=0.5``; a request whose metric is undefined (e.g. tpot of a
one-token answer) does not fail that SLO.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import jsonx
from core.stats import mean, percentiles
from loadgen.client import RequestResult

__all__ = [
    "METRICS",
    "LoadgenRow",
    "SloError",
    "format_summary",
    "meets_slos",
    "parse_slo",
    "summarize",
    "write_results",
    "write_summary",
]

# Per-request metrics summarised, in table order; names match the comparison records.
METRICS: tuple[str, ...] = (
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "chunk_gap_p50_s",
    "chunk_gap_p99_s",
    "tokens_per_event",
    "output_tokens",
)
QUANTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
SLO_KEYS = frozenset(METRICS) | {"send_delay_s"}


class SloError(ValueError):
    """An SLO that cannot be parsed (``--slo ttft_s=0.5``)."""


def parse_slo(text: str) -> tuple[str, float]:
    """``"ttft_s=0.5"`` → ``("ttft_s", 0.5)``: the metric must stay at or below the value."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or key not in SLO_KEYS:
        raise SloError(f"SLO {text!r}: expected NAME=SECONDS with NAME one of {sorted(SLO_KEYS)}")
    try:
        limit = float(value)
    except ValueError as exc:
        raise SloError(f"SLO {text!r}: {value!r} is not a number") from exc
    if not limit > 0 or not math.isfinite(limit):
        raise SloError(f"SLO {text!r}: expected a positive limit")
    return key, limit


def meets_slos(result: Mapping[str, Any], slos: Mapping[str, float]) -> bool:
    """Succeeded and every defined metric named in ``slos`` is at or below its limit."""
    if result.get("error") is not None:
        return False
    for key, limit in slos.items():
        value = result.get(key)
        if value is not None and value > limit:
            return False
    return True


def _metric_summary(values: Sequence[float]) -> dict[str, float | int | None]:
    ps = percentiles(values, QUANTILES)
    out: dict[str, float | int | None] = {"count": len(values), "mean": mean(values)}
    for q, p in zip(QUANTILES, ps, strict=True):
        out[f"p{q:g}"] = p
    out["max"] = max(values) if values else None
    return out


def _group_summary(rows: Sequence[Mapping[str, Any]], slos: Mapping[str, float]) -> dict[str, Any]:
    ok = [r for r in rows if r.get("error") is None]
    errors: dict[str, int] = {}
    for r in rows:
        if r.get("error") is not None:
            kind = str(r.get("error_type") or "error")
            errors[kind] = errors.get(kind, 0) + 1
    metrics = {
        m: _metric_summary([float(r[m]) for r in ok if r.get(m) is not None]) for m in METRICS
    }
    good = sum(1 for r in rows if meets_slos(r, slos))
    return {
        "requests": len(rows),
        "succeeded": len(ok),
        "failed": len(rows) - len(ok),
        "errors": errors,
        "metrics": metrics,
        "good": good,
        "goodput_share": good / len(rows) if rows else None,
        "tokens_sources": sorted({str(r.get("tokens_source")) for r in ok}),
    }


def summarize(
    results: Iterable[RequestResult | Mapping[str, Any]],
    *,
    slos: Mapping[str, float] | None = None,
    wall_s: float | None = None,
    run: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The machine-readable summary of measured requests: overall and per category."""
    slos = dict(slos or {})
    rows = [r.to_json() if isinstance(r, RequestResult) else dict(r) for r in results]
    measured = [r for r in rows if not r.get("warmup")]
    overall = _group_summary(measured, slos)
    categories: dict[str, list[dict[str, Any]]] = {}
    for r in measured:
        categories.setdefault(str(r.get("category") or "uncategorized"), []).append(r)
    out_tokens = sum(int(r["output_tokens"] or 0) for r in measured if r.get("error") is None)
    throughput: dict[str, float | None] = {"requests_per_s": None, "output_tokens_per_s": None}
    goodput_rps = None
    if wall_s is not None and wall_s > 0:
        throughput = {
            "requests_per_s": overall["succeeded"] / wall_s,
            "output_tokens_per_s": out_tokens / wall_s,
        }
        goodput_rps = overall["good"] / wall_s
    return {
        "schema": "specshadow.loadgen.summary/1",
        "run": dict(run or {}),
        "wall_s": wall_s,
        "warmup_requests": len(rows) - len(measured),
        "slos": slos,
        "throughput": throughput,
        "goodput_requests_per_s": goodput_rps,
        "overall": overall,
        "categories": {k: _group_summary(v, slos) for k, v in sorted(categories.items())},
    }


def _ms(value: float | int | None) -> str:
    return "—" if value is None else f"{value * 1e3:.1f}"


def _plain(value: float | int | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def format_summary(summary: Mapping[str, Any]) -> str:
    """A fixed-width table for the terminal (times in ms)."""
    overall = summary["overall"]
    lines = [
        f"requests {overall['requests']}  ok {overall['succeeded']}  failed {overall['failed']}"
        + (f"  errors {overall['errors']}" if overall["errors"] else ""),
    ]
    tp = summary["throughput"]
    if tp["requests_per_s"] is not None:
        lines.append(
            f"throughput {tp['requests_per_s']:.2f} req/s, "
            f"{tp['output_tokens_per_s']:.1f} output tok/s over {summary['wall_s']:.1f} s"
        )
    if summary["slos"]:
        slo_text = ", ".join(f"{k} ≤ {v:g}" for k, v in summary["slos"].items())
        share = overall["goodput_share"]
        rps = summary["goodput_requests_per_s"]
        lines.append(
            f"goodput ({slo_text}): {overall['good']}/{overall['requests']}"
            + (f" = {share:.0%}" if share is not None else "")
            + (f", {rps:.2f} req/s" if rps is not None else "")
        )
    header = f"{'metric':<18}{'mean':>9}{'p50':>9}{'p90':>9}{'p95':>9}{'p99':>9}{'max':>9}"
    lines += ["", header, "-" * len(header)]
    for name in METRICS:
        m = overall["metrics"][name]
        fmt = _ms if name.endswith("_s") else _plain
        label = name.removesuffix("_s") + (" (ms)" if name.endswith("_s") else "")
        cells = [fmt(m[k]) for k in ("mean", "p50", "p90", "p95", "p99", "max")]
        lines.append(f"{label:<18}" + "".join(f"{c:>9}" for c in cells))
    if len(summary["categories"]) > 1:
        lines += ["", f"{'category':<20}{'n':>5}{'ttft p50':>10}{'tpot p50':>10}{'e2e p99':>10}"]
        for name, group in summary["categories"].items():
            gm = group["metrics"]
            lines.append(
                f"{name:<20}{group['requests']:>5}{_ms(gm['ttft_s']['p50']):>10}"
                f"{_ms(gm['tpot_s']['p50']):>10}{_ms(gm['e2e_s']['p99']):>10}"
            )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class LoadgenRow:
    """One per-request line of :func:`write_results` as the report reads it back (the line is
    :meth:`loadgen.client.RequestResult.to_json`; this is its typed reading)."""

    category: str | None
    ok: bool  # no error
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None

    @staticmethod
    def is_request(row: Mapping[str, Any]) -> bool:
        """Whether a result row is a measured request (not a warm-up, not a matrix cell)."""
        return "e2e_s" in row and not row.get("warmup")

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> LoadgenRow:
        def metric(key: str) -> float | None:
            v = row.get(key)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        category = row.get("category")
        return cls(
            category=None if category is None else str(category),
            ok=row.get("error") is None,
            ttft_s=metric("ttft_s"),
            tpot_s=metric("tpot_s"),
            e2e_s=metric("e2e_s"),
        )


def write_results(path: str | Path, results: Iterable[RequestResult]) -> int:
    """Per-request JSONL (warm-ups included, flagged); returns the number of lines."""
    n = 0
    with open(path, "wb") as f:
        for r in results:
            f.write(jsonx.dumps(r.to_json()) + b"\n")
            n += 1
    return n


def write_summary(path: str | Path, summary: Mapping[str, Any]) -> None:
    Path(path).write_bytes(jsonx.dumps(summary, indent=True) + b"\n")
