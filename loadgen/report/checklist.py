"""The release checklist and its rollback triggers, written from the measured numbers (pure).

The thresholds are the ones the rollout guards can carry (``rollout.guards`` in a policy); a
trigger names the number it came from, so an SRE can see why a line says what it says.
"""

from __future__ import annotations

from core.stats import mean
from loadgen.report.analysis import ALL, Analysis


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.1f} ms"


def _p99(a: Analysis, role: str, cat: str, metric: str) -> float | None:
    return a.latency.get((role, cat), {}).get(metric, (None, None, None))[2]


def _category_triggers(a: Analysis, cat: str) -> list[str]:
    """Rollback triggers for one adopted category, from its measured numbers."""
    items: list[str] = []
    c_tpot, p_tpot = _p99(a, "candidate", cat, "tpot_s"), _p99(a, "primary", cat, "tpot_s")
    if c_tpot is not None:
        # 20 % worse than measured, or no better than today's primary: whichever comes first.
        limit = min(c_tpot * 1.2, p_tpot) if p_tpot is not None else c_tpot * 1.2
        items.append(
            f"Roll back {cat} if candidate p99 tpot > {_ms(limit)} "
            f"(measured: candidate {_ms(c_tpot)}, primary {_ms(p_tpot)})."
        )
    c_e2e, p_e2e = _p99(a, "candidate", cat, "e2e_s"), _p99(a, "primary", cat, "e2e_s")
    if c_e2e is not None and p_e2e is not None:
        items.append(
            f"Roll back {cat} if p99 e2e exceeds today's primary p99 of {_ms(p_e2e)} "
            f"(measured candidate: {_ms(c_e2e)})."
        )
    q = a.quality.get(cat)
    if q is not None and q.candidate_divergence.n:
        floor = q.baseline_divergence.value or 0.0
        items.append(
            f"Roll back {cat} if its divergence rate exceeds the noise floor {floor:.1%} + "
            f"{q.tolerance:.1%} = {floor + q.tolerance:.1%} "
            f"(measured candidate: {q.candidate_divergence.value:.1%})."
        )
    m = mean(a.acceptance["category"].get(cat, {}).get("tokens_per_event", []))
    if m is not None and m > 1:
        items.append(
            f"Roll back {cat} if tokens per event falls below {1 + (m - 1) / 2:.2f} (measured "
            f"{m:.2f}: half the speculative gain gone — traffic mix or proposer drift)."
        )
    return items


def checklist(a: Analysis) -> list[str]:
    """The release checklist and rollback triggers, from the main candidate's verdicts."""
    adopted = [v.category for v in a.verdicts if v.decision == "adopt" and v.category != ALL]
    if not adopted and any(v.category == ALL and v.decision == "adopt" for v in a.verdicts):
        adopted = [ALL]
    items: list[str] = []
    if adopted:
        items.append(
            f"Enable speculative decoding for: {', '.join(adopted)}. Keep shadowing the rest."
        )
    else:
        items.append("Do not enable speculative decoding yet: no category passed the verdict.")
    for cat in adopted:
        items.extend(_category_triggers(a, cat))
    cerr, perr = a.errors.get(("candidate", ALL)), a.errors.get(("primary", ALL))
    if cerr is not None and perr is not None and cerr.n and perr.n:
        items.append(
            f"Roll back if the candidate error rate exceeds the primary's by more than 1 point "
            f"(measured: candidate {cerr.value:.1%}, primary {perr.value:.1%})."
        )
    items.extend(
        f"Before deciding {v.category}: shadow about {v.pairs_needed} paired requests."
        for v in a.verdicts
        if v.decision == "not_enough_data" and v.category != ALL and v.pairs_needed
    )
    if a.resources:
        peak = max(r["kv_cache_usage_max"] for r in a.resources.values())
        items.append(
            f"Watch KV-cache usage: peak measured {peak:.0%}; roll back above 95 % sustained."
        )
    main = a.main
    if main is not None and main.crossover is not None:
        items.append(
            f"Speculation stops paying above about {main.crossover.load:.3g} requests/s per "
            f"replica (batch ≈ {main.crossover.concurrency or float('nan'):.3g}): "
            f"num_speculative_tokens_per_batch_size {main.schedule} turns it off there."
        )
    items.append(
        "Keep a shadow baseline leg running after the rollout: the noise floor moves with traffic."
    )
    return items
