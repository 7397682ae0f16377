"""Report figures: matplotlib (Agg, no pyplot global state) rendered to base64 PNG data URIs.

Each function takes the :class:`~report.analysis.Analysis` (or one candidate's
:class:`~report.analysis.CandidateAnalysis`) and returns a ``data:`` URI, or ``None`` when
there is nothing to draw (the report then says so in words).

Size: one function per figure of the report, sharing one style; splitting them apart would only
scatter the style helpers.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from report.analysis import ALL, Analysis, CandidateAnalysis, bucket_order
from report.model import AcceptanceDim
from report.sections import leg_labels

__all__ = ["figures"]

ROLE_COLORS = {"primary": "#3b6ea5", "candidate": "#e07b39", "baseline": "#9a9a9a"}
CANDIDATE_PALETTE = ("#e07b39", "#7b4fa0", "#2a9d8f", "#b5651d", "#d6336c")
DECISION_COLORS = {
    "adopt": "#2e7d32",
    "do_not_adopt": "#c62828",
    "not_enough_data": "#757575",
    "not_load_matched": "#f2a900",
    "candidate_failing": "#c62828",
    "rolled_back": "#c62828",
    "confounded": "#f2a900",
}
_DPI = 110


def _figure(width_in: float = 8.0, height_in: float = 3.4) -> Figure:
    fig = Figure(figsize=(width_in, height_in), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _style(ax: Any) -> None:
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    ax.grid(axis="y", alpha=0.25)


def _uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def speedup_forest(c: CandidateAnalysis, categories: Sequence[str]) -> str | None:
    """Per category: e2e and tpot speedup with 95 % CI; a line at 1 (no change)."""
    speedups = c.speedups
    cats = [k for k in [*categories, ALL] if k in speedups and speedups[k].e2e is not None]
    if not cats:
        return None
    verdict = {v.category: v.decision for v in c.verdicts}
    fig = _figure(8.0, 0.9 + 0.55 * len(cats))
    ax = fig.add_subplot()
    for i, cat in enumerate(reversed(cats)):
        raw = speedups[cat]
        for dy, metric, s, marker in ((0.13, "e2e", raw.e2e, "o"), (-0.13, "tpot", raw.tpot, "s")):
            if s is None:
                continue
            color = DECISION_COLORS[verdict.get(cat, "not_enough_data")]
            ax.errorbar(
                s.point, i + dy, xerr=[[max(0.0, s.point - s.ci_low)], [max(0.0, s.ci_high - s.point)]],
                fmt=marker, color=color, ecolor=color, capsize=3, ms=6,
                mfc=color if metric == "e2e" else "white",
            )  # fmt: skip
    ax.axvline(1.0, color="#333", lw=1, ls="--")
    ns = {k: e2e.n if (e2e := speedups[k].e2e) is not None else 0 for k in cats}
    ax.set_yticks(range(len(cats)), [f"{k} (n={ns[k]})" for k in reversed(cats)])
    ax.set_xlabel("speedup = primary / candidate  (● e2e, □ tpot; > 1 = candidate faster)")
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    ax.grid(axis="x", alpha=0.25)
    return _uri(fig)


def _leg_colors(labels: Sequence[str]) -> dict[str, str]:
    """Colours per leg label: the role's, and one per candidate when there are several."""
    out: dict[str, str] = {}
    candidates = [label for label in labels if label.startswith("candidate ")]
    for label in labels:
        if label in ROLE_COLORS:
            out[label] = ROLE_COLORS[label]
        else:
            out[label] = CANDIDATE_PALETTE[candidates.index(label) % len(CANDIDATE_PALETTE)]
    return out


def latency_bars(a: Analysis) -> str | None:
    """p50 bars with p99 ticks per category and leg (each candidate its own), e2e and tpot."""
    cats = [c for c in [*a.categories, ALL] if ("primary", c) in a.latency]
    labels = leg_labels(a.latency)
    roles = [r for r in labels if any((r, c) in a.latency for c in cats)]
    colors = _leg_colors(roles)
    if not cats or not roles:
        return None
    fig = _figure(9.0, 3.4)
    axes = fig.subplots(1, 2)
    width = 0.8 / len(roles)
    for ax, metric, title in zip(axes, ("e2e_s", "tpot_s"), ("e2e", "tpot"), strict=True):
        for j, role in enumerate(roles):
            xs, p50s, p99s = [], [], []
            for i, cat in enumerate(cats):
                row = a.latency.get((role, cat), {}).get(metric)
                if row is None or row[0] is None:
                    continue
                xs.append(i + (j - (len(roles) - 1) / 2) * width)
                p50s.append(row[0] * 1e3)
                p99s.append((row[2] or row[0]) * 1e3)
            ax.bar(xs, p50s, width * 0.95, color=colors[role], label=role)
            ax.scatter(xs, p99s, marker="_", s=120, color="#222", zorder=3)
        ax.set_xticks(range(len(cats)), cats, rotation=25, ha="right", rotation_mode="anchor")
        ax.set_title(f"{title} (ms): bar p50, tick p99", fontsize=10)
        _style(ax)
    # Above both panels, never over a bar: a tall p99 tick can sit anywhere inside an axes.
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside upper center", ncols=min(len(roles), 4),
               frameon=False, fontsize=8)  # fmt: skip
    return _uri(fig)


def _boxes(ax: Any, groups: Mapping[str, Sequence[float]], color: str) -> None:
    keys = [k for k, v in groups.items() if v]
    if not keys:
        return
    bp = ax.boxplot([groups[k] for k in keys], patch_artist=True, widths=0.55)
    for patch in bp["boxes"]:
        patch.set_facecolor(color)
        patch.set_alpha(0.55)
    # Slanted to the left of their tick: a long name never runs into the next panel.
    ax.set_xticks(range(1, len(keys) + 1), keys, rotation=25, ha="right", rotation_mode="anchor")
    _style(ax)


def acceptance_panels(c: CandidateAnalysis) -> str | None:
    """Candidate tokens per event by category, output length and concurrency; acceptance length."""
    acceptance = c.acceptance
    dims: list[tuple[AcceptanceDim, str]] = [
        ("category", "by category"),
        ("output_length", "by output length (tokens)"),
        ("concurrency", "by concurrency"),
    ]
    present = [
        (d, t) for d, t in dims if any(v.tokens_per_event for v in acceptance.by(d).values())
    ]
    if not present:
        return None
    fig = _figure(3.3 * len(present), 3.2)
    axes = fig.subplots(1, len(present), squeeze=False)[0]
    for ax, (dim, title) in zip(axes, present, strict=True):
        by = acceptance.by(dim)
        groups = {
            k: list(v.tokens_per_event)
            for k, v in sorted(by.items(), key=lambda kv: bucket_order(kv[0]))
        }
        _boxes(ax, groups, ROLE_COLORS["candidate"])
        keys = [k for k, v in groups.items() if v]
        mal = [by[k].mean_acceptance_length for k in keys]
        xs = [i + 1 for i, v in enumerate(mal) if v]
        ys = [sum(v) / len(v) for v in mal if v]
        if xs:
            ax.scatter(
                xs, ys, marker="D", color="#6a3d9a", zorder=3, label="mean acceptance length"
            )
            ax.legend(frameon=False, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))
        ax.set_title(f"tokens per event {title}", fontsize=10)
        ax.axhline(1.0, color="#333", lw=0.8, ls=":")
    return _uri(fig)


def quality_bars(c: CandidateAnalysis, categories: Sequence[str]) -> str | None:
    """Divergence rate, candidate vs baseline (the noise floor), per category, Wilson 95 % CI."""
    quality = c.quality
    cats = [k for k in [*categories, ALL] if k in quality and quality[k].candidate_divergence.n]
    rates = [
        r.value
        for k in cats
        for r in (quality[k].candidate_divergence, quality[k].baseline_divergence)
        if r.n
    ]
    if not any(rates):  # nothing, or every bar zero: the page says "0 of n differ" instead
        return None
    fig = _figure(8.0, 3.0)
    ax = fig.add_subplot()
    for j, (attr, role) in enumerate(
        (("baseline_divergence", "baseline"), ("candidate_divergence", "candidate"))
    ):
        xs, ys, lo, hi = [], [], [], []
        for i, cat in enumerate(cats):
            rate = getattr(quality[cat], attr)
            if not rate.n:
                continue
            ci = rate.interval
            xs.append(i + (j - 0.5) * 0.38)
            ys.append(rate.value * 100)
            # Clipped: a Wilson interval at 0 or 1 can sit a rounding error past the point.
            lo.append(max(0.0, rate.value - ci[0]) * 100)
            hi.append(max(0.0, ci[1] - rate.value) * 100)
        label = (
            "baseline vs primary (noise floor)" if role == "baseline" else "candidate vs primary"
        )
        ax.bar(xs, ys, 0.36, color=ROLE_COLORS[role], label=label, yerr=[lo, hi], capsize=3)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("% not exactly equal")
    ax.legend(frameon=False, fontsize=8)
    _style(ax)
    return _uri(fig)


def gate_bars(a: Analysis) -> str | None:
    """Median share of e2e spent before the first token vs generating, per category."""
    cats = [c for c in [*a.categories, ALL] if a.gate.get(c) is not None]
    if not cats:
        return None
    fig = _figure(8.0, 0.8 + 0.42 * len(cats))
    ax = fig.add_subplot()
    gen = [a.gate[c] or 0.0 for c in reversed(cats)]
    ys = range(len(cats))
    ax.barh(ys, [1 - g for g in gen], color="#b9c7d8", label="waiting for the first token (ttft)")
    ax.barh(ys, gen, left=[1 - g for g in gen], color=ROLE_COLORS["primary"], label="generating")
    ax.axvline(0.5, color="#333", lw=1, ls="--")
    ax.set_yticks(list(ys), list(reversed(cats)))
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of primary response time (median)")
    ax.legend(frameon=False, fontsize=8, loc="lower left", bbox_to_anchor=(0, 1), ncols=2)
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)
    return _uri(fig)


def matrix_speedup(a: Analysis) -> str | None:
    """Per output-length bucket: e2e speedup vs concurrency per backend with CI; stable points
    filled."""
    rows = [r for r in a.matrix if r.speedup_e2e is not None and r.concurrency is not None]
    if not rows:
        return None
    buckets = sorted(
        {str(r.bucket) for r in rows},
        key=lambda b: min(r.max_tokens or 0 for r in rows if str(r.bucket) == b),
    )
    fig = _figure(max(4.2, 3.6 * len(buckets)), 3.3)
    axes = fig.subplots(1, len(buckets), squeeze=False, sharey=True)[0]
    palette = ["#e07b39", "#2e7d32", "#6a3d9a", "#c62828", "#00838f", "#8d6e63"]
    backends = sorted({str(r.backend) for r in rows})
    for ax, bucket in zip(axes, buckets, strict=True):
        for k, backend in enumerate(backends):
            cells = sorted(
                (r for r in rows if str(r.bucket) == bucket and str(r.backend) == backend),
                key=lambda r: r.concurrency or 0,
            )
            if not cells:
                continue
            color = palette[k % len(palette)]
            xs = [r.concurrency or 0 for r in cells]
            ax.fill_between(
                xs,
                [r.speedup_e2e_ci_low for r in cells],
                [r.speedup_e2e_ci_high for r in cells],
                color=color,
                alpha=0.18,
            )
            ax.plot(xs, [r.speedup_e2e for r in cells], color=color, label=backend, lw=1.5)
            for r in cells:
                ax.scatter(
                    [r.concurrency],
                    [r.speedup_e2e],
                    color=color,
                    zorder=3,
                    s=30,
                    facecolors=color if r.stable else "white",
                )
        ax.axhline(1.0, color="#333", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        concs = sorted({r.concurrency or 0 for r in rows})
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_title(f"output bucket {bucket}", fontsize=10)
        ax.set_xlabel("concurrency")
        _style(ax)
    axes[0].set_ylabel("e2e speedup vs reference")
    axes[0].legend(frameon=False, fontsize=8)
    return _uri(fig)


def matrix_acceptance(a: Analysis) -> str | None:
    """Tokens per event vs concurrency per backend (and bucket), from the matrix."""
    rows = [
        r for r in a.matrix if r.tokens_per_event_mean is not None and r.concurrency is not None
    ]
    if not rows:
        return None
    fig = _figure(7.5, 3.0)
    ax = fig.add_subplot()
    keys = sorted({(str(r.backend), str(r.bucket)) for r in rows})
    for backend, bucket in keys:
        cells = sorted(
            (r for r in rows if str(r.backend) == backend and str(r.bucket) == bucket),
            key=lambda r: r.concurrency or 0,
        )
        ax.plot(
            [r.concurrency or 0 for r in cells],
            [r.tokens_per_event_mean or 0.0 for r in cells],
            marker="o",
            label=f"{backend} · {bucket}",
        )
    ax.set_xscale("log", base=2)
    concs = sorted({r.concurrency or 0 for r in rows})
    ax.set_xticks(concs, [str(c) for c in concs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tokens per event (mean)")
    ax.legend(frameon=False, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    _style(ax)
    return _uri(fig)


def counterfactual_depths(a: Analysis) -> str | None:
    """Against k, per proposer family, all traffic: the predicted mean acceptance length (95 %
    CI band; a live candidate's measured value as a star at its k) and — what the pick is made
    on — the predicted TPOT speed-up (its interval; plain decoding at 1; the pick ringed).
    Without a fitted step model the pick ranks tokens per pass, and the right panel shows that."""
    m = a.counterfactual
    if m is None:
        return None
    # Fixed k only: a dynamic rule has no single k to plot at (its rows are in the tables).
    rows = [
        r
        for r in m.rows
        if r["category"] == ALL and r["output_length_bucket"] == ALL and r["rule"] is None
    ]

    def family(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (r["proposer"], r["prompt_lookup_min"], r["prompt_lookup_max"], r["drafter"])

    if not rows:
        return None
    by_speedup = any(r.get("predicted_tpot_speedup") is not None for r in rows)

    def score(r: Mapping[str, Any]) -> tuple[float | None, float | None, float | None]:
        if by_speedup:
            interval = r.get("predicted_tpot_speedup_interval") or {}
            v = r.get("predicted_tpot_speedup")
            return v, interval.get("low", v), interval.get("high", v)
        t = r.get("tokens_per_pass") or {}
        return t.get("estimate"), t.get("low"), t.get("high")

    fig = _figure(9.5, 3.0)
    left, right = fig.subplots(1, 2)
    for fam in sorted({family(r) for r in rows}, key=str):
        cells = sorted((r for r in rows if family(r) == fam), key=lambda r: r["num_speculative_tokens"])  # fmt: skip
        ks = [r["num_speculative_tokens"] for r in cells]
        est = [r["mean_acceptance_length"]["estimate"] or 1.0 for r in cells]
        lo = [r["mean_acceptance_length"]["low"] or e for r, e in zip(cells, est, strict=True)]
        hi = [r["mean_acceptance_length"]["high"] or e for r, e in zip(cells, est, strict=True)]
        name = f"ngram lookup {fam[1]}-{fam[2]}" if fam[0] == "ngram" else f"draft {fam[3]}"
        (line,) = left.plot(ks, est, marker="o", label=name)
        left.fill_between(ks, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        scored: list[tuple[int, float, float, float]] = []
        for k, r in zip(ks, cells, strict=True):
            v, low, high = score(r)
            if v is not None:
                scored.append((k, v, v if low is None else low, v if high is None else high))
        if scored:
            sk = [x[0] for x in scored]
            (mark,) = right.plot(sk, [x[1] for x in scored], marker="o", color=line.get_color())
            right.fill_between(
                sk, [x[2] for x in scored], [x[3] for x in scored],
                color=mark.get_color(), alpha=0.15, linewidth=0,
            )  # fmt: skip
    for live in m.live:
        measured = live["measured_mean_acceptance_length"]["estimate"]
        if measured is not None:
            left.plot([live["num_speculative_tokens"]], [measured], marker="*", markersize=12,
                      color="black", linestyle="none", label=f"{live['backend']} measured")  # fmt: skip
    pick = (m.picks.get(ALL) or {}).get("config")
    if pick is not None:
        chosen = next(
            (r for r in rows if all(r.get(k) == v for k, v in pick.items() if k in r)), None
        )
        if chosen is not None and score(chosen)[0] is not None:
            right.plot([chosen["num_speculative_tokens"]], [float(score(chosen)[0] or 0.0)],
                       marker="o", markersize=13, markerfacecolor="none", markeredgecolor="black",
                       linestyle="none", label=f"the pick: {chosen['label']}")  # fmt: skip
    right.axhline(1.0, color="#999", linestyle="--", linewidth=0.8)
    left.set_xlabel("num_speculative_tokens (k)")
    left.set_ylabel("mean acceptance length")
    right.set_xlabel("num_speculative_tokens (k)")
    right.set_ylabel("predicted TPOT speed-up" if by_speedup else "tokens per pass")
    right.set_title("what the pick is made on (1 = plain decoding)", fontsize=8)
    left.set_title("predicted acceptance (★ measured live)", fontsize=8)
    handles = [*left.get_legend_handles_labels()[0], *right.get_legend_handles_labels()[0]]
    labels = [*left.get_legend_handles_labels()[1], *right.get_legend_handles_labels()[1]]
    fig.legend(handles, labels, frameon=False, fontsize=7, loc="outside right center")
    _style(left)
    _style(right)
    return _uri(fig)


def speedup_vs_load(a: Analysis) -> str | None:
    """Each candidate's e2e speed-up against its per-replica arrival rate, with 95 % CIs; the
    production operating range (p5–p95 of the primary's per-replica rate) shaded; the
    crossover marked."""
    curves = {b: c for b, c in a.candidates.items() if c.load_points}
    if not curves:
        return None
    fig = _figure(8.0, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    palette = CANDIDATE_PALETTE
    for i, c in enumerate(curves.values()):
        xs = [p.load for p in c.load_points]
        ys = [p.e2e_speedup for p in c.load_points]
        lo = [p.e2e_speedup - p.low for p in c.load_points]
        hi = [p.high - p.e2e_speedup for p in c.load_points]
        color = palette[i % len(palette)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", color=color, capsize=3, label=c.label)
        if c.crossover is not None:
            ax.axvline(c.crossover.load, color=color, linestyle=":", linewidth=1)
    main = a.main
    band = main.load.get(ALL) if main is not None else None
    if band is not None and band.primary_load_p5 is not None and band.primary_load_p95 is not None:
        ax.axvspan(band.primary_load_p5, band.primary_load_p95, color="#3b6ea5", alpha=0.12,
                   label="production's range (p5–p95)")  # fmt: skip
    ax.axhline(1.0, color="#333", linestyle="--", linewidth=1)
    ax.set_xlabel("candidate's arrival rate per replica (requests/s)")
    ax.set_ylabel("e2e speed-up (reference / candidate)")
    ax.legend(frameon=False, fontsize=8)
    _style(ax)
    return _uri(fig)


def head_to_head_forest(a: Analysis) -> str | None:
    """Each pair of candidates per category: e2e ratio on the same requests with 95 % CI."""
    rows = [h for h in a.head_to_head if h.e2e is not None]
    if not rows:
        return None
    labels = {b: c.label for b, c in a.candidates.items()}
    fig = _figure(8.0, 0.9 + 0.42 * len(rows))
    ax = fig.add_subplot()
    for i, h in enumerate(reversed(rows)):
        s = h.e2e
        assert s is not None
        color = "#2e7d32" if s.significant_gain else "#c62828" if s.significant_loss else "#757575"
        ax.errorbar(
            s.point, i, xerr=[[max(0.0, s.point - s.ci_low)], [max(0.0, s.ci_high - s.point)]],
            fmt="o", color=color, ecolor=color, capsize=3,
        )  # fmt: skip
    ax.axvline(1.0, color="#333", lw=1, ls="--")
    ticks = [f"{h.category}: {labels[h.b]} vs {labels[h.a]} (n={h.e2e.n})" for h in reversed(rows)]  # type: ignore[union-attr]
    ax.set_yticks(range(len(rows)), ticks)
    ax.set_xlabel("e2e ratio on the same requests (> 1: the first named is faster)")
    _style(ax)
    return _uri(fig)


def figures(a: Analysis) -> dict[str, str | None]:
    """Every figure by name (``None`` where there was nothing to draw); per-candidate figures are
    named ``<figure>:<backend>``."""
    out = {
        "speedup_vs_load": speedup_vs_load(a),
        "latency": latency_bars(a),
        "gate": gate_bars(a),
        "matrix_speedup": matrix_speedup(a),
        "matrix_acceptance": matrix_acceptance(a),
        "head_to_head": head_to_head_forest(a) if a.several else None,
        "counterfactual": counterfactual_depths(a),
    }
    for backend, c in a.candidates.items():
        out[f"speedup:{backend}"] = speedup_forest(c, a.categories)
        out[f"acceptance:{backend}"] = acceptance_panels(c)
        out[f"quality:{backend}"] = quality_bars(c, a.categories)
    return out
