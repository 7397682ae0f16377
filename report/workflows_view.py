"""The workflow section in every form the report takes (pure): ``report.json``'s ``workflows``,
the first screen's line, the Markdown table and the HTML table. The numbers are
:mod:`report.workflows`'; this module only words and lays them out."""

from __future__ import annotations

from typing import Any

from report.workflows import GATE_SHARE, Projection, Workflows, WorkflowType

__all__ = ["HEAD", "TITLE", "first_line", "intro", "rows", "workflows_json"]

MODEL = (
    "time between calls kept; each call's TTFT × its candidate TTFT ratio and decode ÷ its "
    "TPOT speed-up (paired where mirrored, else the type's pooled ratios); overlapping calls "
    "count once; the ratio of mean run times, 95 % percentile bootstrap over runs"
)


def _projection_json(t: WorkflowType, p: Projection) -> dict[str, Any]:
    return {
        "estimate": p.estimate,
        "low": p.low,
        "high": p.high,
        "candidate": p.backend,
        "runs": t.runs,
        "per_call_tpot_speedup": p.per_call_speedup,
        "ttft_ratio": p.ttft_ratio,
        "mirrored_calls": p.mirrored,
        "calls": p.calls,
        "amdahl": t.amdahl(p.per_call_speedup),
    }


def workflows_json(w: Workflows | None) -> dict[str, Any]:
    """``workflows.<type>``: the runs' shape, the gate and ``projected_e2e_speedup`` (the
    headline candidate's; ``candidates.<backend>`` has every candidate's). Empty: no runs."""
    if w is None:
        return {}
    out: dict[str, Any] = {}
    for name, t in w.types.items():
        head = t.headline
        out[name] = {
            "named_by_header": t.named,
            "runs": t.runs,
            "calls_per_run": t.calls_per_run,
            "ttft_s_per_call": t.ttft_s,
            "decode_s_per_call": t.decode_s,
            "between_s": t.between_s,
            "wall_s": t.wall_s,
            "llm_share": t.llm_share,
            "generation_share": t.generation_share,
            "gate_share": GATE_SHARE,
            "below_gate": t.below_gate,
            "gate": t.gate_sentence(),
            "projected_e2e_speedup": None if head is None else _projection_json(t, head),
            "candidates": {b: _projection_json(t, p) for b, p in t.projections.items()},
            "model": MODEL,
        }
    return out


def _speed(p: Projection | None) -> str:
    if p is None:
        return "no candidate mirrored"
    ci = f" [{p.low:.2f}, {p.high:.2f}]" if p.low is not None and p.high is not None else ""
    return f"{p.estimate:.2f}×{ci}"


def first_line(w: Workflows | None, labels: dict[str, str]) -> tuple[str, str] | None:
    """(title, text) of the first screen's workflow line: each type's projected run speed-up
    and its gate, the most frequent type first."""
    if w is None or not w.types:
        return None
    parts = []
    for t in w.types.values():
        head = t.headline
        who = f" with {labels.get(head.backend, head.backend)}" if head is not None else ""
        per_call = f", per call {head.per_call_speedup:.2f}×" if head is not None else ""
        parts.append(
            f"{t.name} ({t.runs} runs, {t.calls_per_run:.1f} calls each): the run "
            f"{_speed(head)}{who}{per_call}; {t.gate_sentence()}"
        )
    return "Whole runs", ". ".join(parts) + "."


HEAD = (
    "type", "runs", "calls/run", "TTFT/call", "decode/call", "between calls/run",
    "generation share", "per-call speed-up", "projected run speed-up", "gate",
)  # fmt: skip
TITLE = "Workflows: the whole run"


def intro(w: Workflows) -> str:
    left = ", ".join(f"{n} ({why})" for why, n in w.left_out.items())
    return (
        f"{w.runs} runs of {w.calls} calls, grouped by the client's trace id (or the policy's "
        "session header) and typed by the workflow header, else by route/category; "
        + (
            f"{w.spanned} with their true start and end from the application's own spans. "
            if w.spanned
            else "each timed from its first call's start to its last call's end (no application "
            "spans). "
        )
        + f"Projection: {MODEL}."
        + (f" Runs left out: {left}." if left else "")
    )


def rows(w: Workflows) -> list[list[str]]:
    """One row per workflow type, in :data:`HEAD`'s order."""
    out = []
    for t in w.types.values():
        head = t.headline
        out.append(
            [
                t.name,
                str(t.runs),
                f"{t.calls_per_run:.1f}",
                f"{t.ttft_s * 1e3:.0f} ms",
                f"{t.decode_s * 1e3:.0f} ms",
                f"{t.between_s:.2f} s",
                f"{t.generation_share:.0%}",
                "–" if head is None else f"{head.per_call_speedup:.2f}×",
                _speed(head),
                t.gate_sentence(),
            ]
        )
    return out
