"""Report rendering: :class:`~report.analysis.Analysis` + figures → one self-contained
HTML page (inline CSS, images as data URIs, no scripts, no network) (pure). The Markdown summary
(:mod:`report.markdown`) reuses the table builders here.

One candidate: verdict cards, then its sections. Several: a category × candidate verdict table
with the pick, the candidates' identities, their head-to-head on the same requests, then each
candidate's own sections — never one pooled "candidate".

Size: the sections of one HTML page, each a small pure builder; the shared table builders are
reused by the Markdown summary.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any

from counterfactual.matrix import Matrix
from loadgen.matrix import MatrixRow
from loadgen.results import LoadgenRow
from loadgen.speedup import Speedup
from report import workflows_view as wv
from report.analysis import ALL, GATE_SHARE, Analysis, CandidateAnalysis, Verdict
from report.candidates import RULE
from report.front import first_use, front
from report.load import MIN_COVERAGE, OPEN_LOOP, PARITY_BAND, Estimate
from report.model import AcceptanceDim
from report.sections import Rate, bucket_order, leg_labels

__all__ = ["render_html"]

_CSS = """
:root{--ink:#1d2330;--muted:#5b6472;--line:#e3e6ea;--bg:#f7f8fa;--adopt:#2e7d32;--no:#c62828;--nd:#757575}
*{box-sizing:border-box}body{margin:0;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--ink);background:var(--bg)}
main{max-width:1280px;margin:0 auto;padding:28px 28px 60px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:19px;margin:34px 0 10px;padding-top:10px;border-top:1px solid var(--line)}
h3{font-size:15px;margin:18px 0 6px}.sub{color:var(--muted);margin:0 0 18px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(235px,1fr));gap:12px}
.card{background:#fff;border:1px solid var(--line);border-left:6px solid var(--nd);border-radius:8px;padding:12px 14px}
.card.adopt{border-left-color:var(--adopt)}.card.no{border-left-color:var(--no)}
.card .cat{font-weight:600}.card .dec{font-size:18px;font-weight:700;margin:2px 0}
.adopt .dec{color:var(--adopt)}.no .dec{color:var(--no)}.nd .dec{color:var(--nd)}
.card ul{margin:6px 0 0;padding-left:18px;color:var(--muted);font-size:13px}
.callout{background:#fff;border:1px solid var(--line);border-radius:8px;padding:12px 16px;margin:10px 0}
.callout.warn{border-left:6px solid #f2a900}.callout.ok{border-left:6px solid var(--adopt)}
figure{margin:10px 0;background:#fff;border:1px solid var(--line);border-radius:8px;padding:8px;text-align:center}
figure img{max-width:100%;height:auto}figcaption{color:var(--muted);font-size:13px}
div.scroll{overflow-x:auto;margin:8px 0;background:#fff;border:1px solid var(--line);border-radius:8px}
table{border-collapse:collapse;width:100%;font-size:12.5px;font-variant-numeric:tabular-nums}
th,td{padding:4px 7px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}tr:last-child td{border-bottom:0}
th:first-child,td:first-child,th.l,td.l,td.wrap{text-align:left}td.wrap{white-space:normal;min-width:14em;overflow-wrap:anywhere}@media (max-width:1000px){td.wrap{min-width:9em}td{white-space:normal}}th{background:#eef1f5;font-weight:600;white-space:normal;vertical-align:bottom;line-height:1.25}
ol.check li{margin:4px 0}.muted{color:var(--muted)}code{background:#eef1f5;padding:0 4px;border-radius:3px}
.callout.bad{border-left:6px solid var(--no)}.glance{margin:6px 0 4px}.glance ul{margin:6px 0;padding-left:20px}.glance li{margin:3px 0}
nav.toc{background:#fff;border:1px solid var(--line);border-radius:8px;padding:8px 16px;margin:14px 0;font-size:13.5px;columns:2 22em}
nav.toc ol{margin:4px 0;padding-left:20px}nav.toc a{color:var(--ink)}p.gloss{color:var(--muted);font-size:13px;margin:4px 0 10px;padding-left:10px;border-left:3px solid var(--line)}
pre{white-space:pre-wrap;background:#fff;border:1px solid var(--line);padding:8px;border-radius:6px;font-size:12px;max-height:160px;overflow:auto}
pre.code{max-height:none}
"""

_CLASS = {"adopt": "adopt", "do_not_adopt": "no", "not_enough_data": "nd", "not_load_matched": "nd",
          "candidate_failing": "no", "rolled_back": "no", "confounded": "nd"}  # fmt: skip


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def _rate(r: Rate) -> str:
    return f"{_pct(r.value)} ({r.k}/{r.n})" if r.n else "—"


def sp(s: Speedup | None) -> str:
    return "—" if s is None else f"{s.point:.2f}× [{s.ci_low:.2f}, {s.ci_high:.2f}]"


def est(e: Estimate | None) -> str:
    return "—" if e is None else f"{e.estimate:.2f}× [{e.low:.2f}, {e.high:.2f}]"


def _num(v: float | None, fmt: str = ".3g") -> str:
    return "—" if v is None else format(v, fmt)


def _figure(uri: str | None, caption: str, empty: str) -> str:
    if uri is None:
        return f'<p class="muted">{escape(empty)}</p>'
    return f'<figure><img src="{uri}" alt="{escape(caption)}"><figcaption>{escape(caption)}</figcaption></figure>'


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], *, wrap: Sequence[int] = ()) -> str:
    """A table in a scrolling card; columns in ``wrap`` (indices) hold prose and wrap."""
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="wrap">{escape(c)}</td>' if i in wrap else f"<td>{escape(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f'<div class="scroll"><table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>'


def _e2e_point(v: Verdict) -> float | None:
    """The category's e2e speed-up: at production's load where known, else the raw one."""
    if v.at_load is not None and v.at_load.e2e is not None:
        return v.at_load.e2e.estimate
    return v.e2e.point if v.e2e is not None else None


def _card(v: Verdict) -> str:
    label = "All traffic (one switch)" if v.category == ALL else v.category
    reasons = "".join(f"<li>{escape(r)}</li>" for r in v.reasons)
    needed = (
        f"<li>sample size needed: about {v.pairs_needed} paired requests</li>"
        if v.decision == "not_enough_data" and v.pairs_needed
        else ""
    )
    return (
        f'<div class="card {_CLASS[v.decision]}"><div class="cat">{escape(label)}</div>'
        f'<div class="dec">{escape(v.label.capitalize())}</div><ul>{reasons}{needed}</ul></div>'
    )


def _load_rows(c: CandidateAnalysis, categories: Sequence[str]) -> list[list[str]]:
    rows = []
    for cat in [*categories, ALL]:
        at = c.load.get(cat)
        if at is None:
            continue
        rows.append([
            cat, est(at.e2e), est(at.tpot), f"{at.matched_pairs}/{at.mirrored_pairs}",
            _num(at.parity_p50, ".2f"), f"{at.coverage:.0%}",
            _num(at.primary_load_p50), _num(at.candidate_load_p50),
        ])  # fmt: skip
    return rows


def _capacity_rows(a: Analysis, c: CandidateAnalysis) -> list[list[str]]:
    cap = c.capacity
    rows = []
    for backend in sorted(cap.kv_per_request):
        per = cap.kv_per_request[backend]
        rows.append([backend, f"{per:.2%}", _num(cap.max_concurrency(backend), ".0f")])
    return rows


def _load_section(
    a: Analysis, c: CandidateAnalysis, figs: Mapping[str, str | None], of: str = ""
) -> list[str]:
    cap = c.capacity
    cross = c.crossover
    exclusions: Mapping[str, int] = c.exclusions.get(ALL, {})
    parts = [
        f"<h2>Load: measured at production's load?{of}</h2>",
        '<p class="muted">A speed-up holds only at the load it was measured at: speculation wins at low batch and loses at high batch, '
        "and a shadow sees only the mirrored share of traffic. Per-replica arrival rate must match production's (load parity 1); "
        f"pairs within ±{PARITY_BAND - 1:.0%} count, re-weighted to production's own load distribution, and the verdict needs them to cover "
        f"{MIN_COVERAGE:.0%} of it. {escape(OPEN_LOOP)}</p>",
        _table(["category", "e2e at production load", "tpot at production load", "matched / mirrored pairs",
                "load parity p50", "coverage", "production req/s per replica p50", "candidate req/s per replica p50"],
               _load_rows(c, a.categories)),
    ]  # fmt: skip
    if not a.several:  # with several candidates the figure, all curves in one, heads the report
        parts.append(_figure(figs.get("speedup_vs_load"), "Speed-up against the candidate's per-replica arrival rate, 95 % CI; shaded: production's operating range (p5–p95)",
                             "No pairs at a known load: no speed-up against load."))  # fmt: skip
    if cross is not None:
        parts.append(
            f'<div class="callout warn">Speculation stops paying at about <b>{cross.load:.3g} requests/s per replica</b> '
            f"(batch ≈ {_num(cross.concurrency)}). Recommended depth schedule "
            f"(<code>num_speculative_tokens_per_batch_size</code>): <code>{escape(str(c.schedule))}</code>.</div>"
        )
    elif c.load_points:
        # All traffic paid at every load; a category that did not is said here, not under green.
        losing = [f"{v.category} ({x:.2f}×)" for v in c.verdicts
                  if v.category != ALL and (x := _e2e_point(v)) is not None and x < 1.0]  # fmt: skip
        but = f" — but not for {escape(', '.join(losing))}" if losing else ""
        parts.append(
            f'<div class="callout {"warn" if losing else "ok"}">No crossover up to {c.load_points[-1].load:.3g} requests/s per replica: '
            f"speculation paid at every load measured, all traffic{but}. Schedule: <code>{escape(str(c.schedule))}</code>.</div>"
        )
    problems = cap.problems(c.backend)
    parts.append("<h3>Capacity</h3>")
    budget = cap.admission_drops
    breaker = cap.dropped.get("breaker_open", 0)
    parts.append(
        f"<p>{cap.sampled} candidate legs chosen by the policy; the shadow budget dropped "
        f"{budget} ({budget / cap.sampled if cap.sampled else 0.0:.1%})"
        + (f", its open breaker kept back {breaker} (failures, not load)" if breaker else "")
        + f"; production's peak concurrency per replica {_num(cap.production_peak_concurrency)}.</p>"
    )
    if cap.kv_per_request:
        parts.append(
            _table(
                ["backend", "KV cache per running request", "requests that fit (100 % KV)"],
                _capacity_rows(a, c),
            )
        )
    if problems:
        parts.append(
            '<div class="callout warn">' + "<br>".join(escape(p) for p in problems) + "</div>"
        )
    if exclusions:
        parts.append("<h3>Exchanges in and out of the verdict</h3>")
        parts.append(
            _table(
                ["reason", "exchanges"],
                [[r, str(n)] for r, n in sorted(exclusions.items(), key=lambda kv: -kv[1])],
            )
        )
    parts.extend(f'<p class="muted">{escape(note)}</p>' for note in a.notes if note != OPEN_LOOP)
    return parts


def gate_text(a: Analysis) -> tuple[str, str]:
    share = a.gate_overall
    if share is None:
        return (
            "warn",
            "No primary timings with both ttft and e2e: the decision gate cannot be computed.",
        )
    if share < GATE_SHARE:
        return "warn", (
            f"Only {share:.0%} of the primary's response time is spent generating (median). "
            "Speculative decoding speeds up generation only, so it is rarely the first optimisation "
            "here: look at queueing, prefill and time to first token first."
        )
    return "ok", (
        f"{share:.0%} of the primary's response time is spent generating (median): generation "
        "dominates, so faster decoding moves end-to-end latency."
    )


def _latency_rows(a: Analysis) -> list[list[str]]:
    rows = []
    labels = leg_labels(a.latency)
    for cat in [*a.categories, ALL]:
        for role in labels:
            lat = a.latency.get((role, cat))
            if lat is None:
                continue
            cells = [cat, role, str(a.latency_n.get((role, cat), 0))]
            for m in ("ttft_s", "tpot_s", "chunk_gap_p50_s", "e2e_s"):
                cells += [_ms(v) for v in lat[m]]
            err = a.errors.get((role, cat))
            cells.append(_pct(err.value) if err is not None else "—")
            rows.append(cells)
    return rows


_LAT_HEAD = [
    "category", "role", "n",
    "ttft p50", "p95", "p99", "tpot p50", "p95", "p99",
    "chunk gap p50", "p95", "p99", "e2e p50", "p95", "p99", "errors",
]  # fmt: skip


def _acceptance_rows(c: CandidateAnalysis) -> list[list[str]]:
    rows = []
    dims: tuple[tuple[AcceptanceDim, str], ...] = (
        ("category", "category"),
        ("output_length", "output length"),
        ("concurrency", "concurrency"),
    )

    def m(vals: Sequence[float]) -> str:
        return f"{sum(vals) / len(vals):.2f}" if vals else "—"

    for dim, label in dims:
        for key, v in sorted(c.acceptance.by(dim).items(), key=lambda kv: bucket_order(kv[0])):
            rows.append([
                f"{label}: {key}", str(len(v.tokens_per_event)), m(v.tokens_per_event),
                m(v.mean_acceptance_length), m(v.draft_acceptance_rate), m(v.coverage),
            ])  # fmt: skip
    return rows


EQUIVALENCE_HEAD = ["category", "verdict", "decided by", "sampled exchanges", "more needed", "MMD² (p)", "tests and effects"]  # fmt: skip


def equivalence_rows(c: CandidateAnalysis, categories: Sequence[str]) -> list[list[str]]:
    """One row per category: the quality verdict, what decided it, the effects with intervals."""
    rows = []
    for cat in [*categories, ALL]:
        eq = c.equivalence.get(cat)
        if eq is None:
            continue
        mmd = "—" if eq.mmd is None else f"{eq.mmd.statistic:.4f} ({eq.mmd.p_value:.3f})"
        effects = "; ".join(
            t.text() + ("" if t.inside else " — outside") for t in eq.metrics.values()
        )
        rows.append([
            cat, eq.verdict, eq.decided_by or "—", str(eq.n),
            "—" if eq.needed is None else str(eq.needed), mmd, effects or eq.summary(),
        ])  # fmt: skip
    return rows


def quality_rows(c: CandidateAnalysis, categories: Sequence[str]) -> list[list[str]]:
    rows = []
    for cat in [*categories, ALL]:
        q = c.quality.get(cat)
        if q is None:
            continue
        worse = q.worse_than_noise
        rows.append([
            cat, _rate(q.candidate_divergence), _rate(q.baseline_divergence),
            "—" if worse is None else ("worse" if worse else "within"),
            str(q.flagged), _rate(q.json_valid), _rate(q.json_equal), _rate(q.tools_equal),
            str(q.one_sided_refusals),
            "—" if q.similarity_p50 is None else f"{q.similarity_p50:.3f}",
        ])  # fmt: skip
    return rows


def _matrix_rows(rows: Sequence[MatrixRow]) -> list[list[str]]:
    out = []
    for r in rows:
        sp = "reference" if r.backend == r.reference else "—"
        if r.speedup_e2e is not None:
            sp = f"{r.speedup_e2e:.2f}× [{_2f(r.speedup_e2e_ci_low)}, {_2f(r.speedup_e2e_ci_high)}]"
        tpe = r.tokens_per_event_mean
        gp = r.goodput_share
        out.append([
            str(r.backend), str(r.proposer), str(r.depth), str(r.bucket),
            str(r.concurrency), f"{r.succeeded}/{r.requests}",
            _ms(r.ttft_s_p50), _ms(r.tpot_s_p50), _ms(r.e2e_s_p99),
            "—" if tpe is None else f"{tpe:.2f}", "—" if gp is None else f"{gp:.0%}",
            sp, "yes" if r.stable else ("" if r.stable is None else "no"),
        ])  # fmt: skip
    return out


def _2f(x: float | None) -> str:
    return "None" if x is None else f"{x:.2f}"


def _loadgen_rows(rows: Sequence[LoadgenRow]) -> list[list[str]]:
    from core.stats import percentiles

    groups: dict[str, list[LoadgenRow]] = {}
    for r in rows:
        groups.setdefault(r.category or "uncategorized", []).append(r)
        groups.setdefault(ALL, []).append(r)
    out = []
    for cat, rs in groups.items():
        ok = [r for r in rs if r.ok]
        cells = [cat, f"{len(ok)}/{len(rs)}"]
        for values in (
            [r.ttft_s for r in ok if r.ttft_s is not None],
            [r.tpot_s for r in ok if r.tpot_s is not None],
            [r.e2e_s for r in ok if r.e2e_s is not None],
        ):
            p50, p99 = percentiles(values, (50.0, 99.0))
            cells += [_ms(p50), _ms(p99)]
        out.append(cells)
    return out


_CLAIMS = {"lossless": "lossless", "not_lossless": "not lossless", "unverified": "not verified"}
CAND_HEAD = [
    "candidate",
    "backend",
    "method",
    "k",
    "verification",
    "lossless?",
    "why",
    "disagreements",
]


def candidate_rows(a: Analysis) -> list[list[str]]:
    rows = []
    for c in a.candidates.values():
        s, claim = c.speculation, c.lossless
        verification = "—"
        if s is not None and s.verification is not None:
            verification = f"{s.verification} ({s.verification_source}: {s.verification_detail})"
        rows.append([
            c.label, c.backend,
            (s.method if s is not None else None) or "—",
            str(c.depth) if c.depth is not None else "—",
            verification,
            _CLAIMS[claim.claim] if claim is not None else "—",
            claim.reason if claim is not None else "",
            "; ".join(s.mismatches) if s is not None and s.mismatches else "none",
        ])  # fmt: skip
    return rows


def verdict_cell(v: Verdict | None) -> str:
    if v is None:
        return "—"
    at = v.at_load.e2e if v.at_load is not None else None
    return v.label + (f" · {est(at)}" if at is not None else "")


def verdict_matrix(a: Analysis) -> tuple[list[str], list[list[str]]]:
    """Category rows × candidate columns (verdict and speed-up at production load), and the pick."""
    head = ["category", *(c.label for c in a.candidates.values()), "recommended"]
    rows = []
    for cat in [*a.categories, ALL]:
        by = {
            c.backend: next((v for v in c.verdicts if v.category == cat), None)
            for c in a.candidates.values()
        }
        pick = a.recommendations.get(cat)
        picked = a.candidates[pick.backend].label if pick is not None and pick.backend else "none"
        rows.append(
            ["all traffic" if cat == ALL else cat, *(verdict_cell(v) for v in by.values()), picked]
        )
    return head, rows


def rollout_rows(a: Analysis) -> list[list[str]]:
    def at(ns: int) -> str:
        return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%H:%M:%S")

    return [
        [s.rule, s.stage, at(s.first_unix_ns), at(s.last_unix_ns), str(s.exchanges),
         str(s.served_by_candidate), str(s.failovers)]
        for s in a.rollout
    ]  # fmt: skip


def recommendation_rows(a: Analysis) -> list[list[str]]:
    rows = []
    for cat, r in a.recommendations.items():
        label = a.candidates[r.backend].label if r.backend is not None else "none"
        rows.append(["all traffic" if cat == ALL else cat, label, r.reason])
    return rows


def head_to_head_rows(a: Analysis) -> list[list[str]]:
    labels = {b: c.label for b, c in a.candidates.items()}
    rows = []
    for h in a.head_to_head:
        if h.mirrored == 0:
            continue
        verdict = (
            f"{labels[h.b]} faster" if h.b_faster else f"{labels[h.a]} faster" if h.a_faster
            else "not distinguishable" if h.e2e is not None else "too few pairs"
        )  # fmt: skip
        rows.append([
            h.category, f"{labels[h.b]} vs {labels[h.a]}", sp(h.e2e), sp(h.tpot),
            f"{h.e2e.n if h.e2e else 0}/{h.mirrored}", verdict,
        ])  # fmt: skip
    return rows


def _speed_rows(a: Analysis, c: CandidateAnalysis) -> list[list[str]]:
    rows = []
    for k in [*a.categories, ALL]:
        if k not in c.speedups:
            continue
        s = c.speedups[k]
        e2e = s.e2e
        rows.append([k, str(e2e.n if e2e is not None else 0), sp(e2e), sp(s.tpot),
                     sp(s.ttft), sp(s.baseline_e2e)])  # fmt: skip
    return rows


def failure_rows(c: CandidateAnalysis) -> list[list[str]]:
    f = c.failures
    rows = [
        ["could not connect", str(f.connect)],
        *([f"HTTP {status}", str(n)] for status, n in sorted(f.http.items())),
        ["timed out", str(f.timeout)],
        *([f"other: {kind}", str(n)] for kind, n in f.other.most_common()),
        ["dropped with its breaker open", str(f.breaker)],
        ["dropped for the shared shadow budget (not counted against it)", str(f.budget)],
        ["sent and answered", str(f.sent - f.failed)],
    ]
    return rows


def _failures_section(c: CandidateAnalysis, of: str) -> list[str]:
    f = c.failures
    first = (
        f"First error: <b>{escape(f.first.kind)}</b> at {escape(f.first.at())} "
        f"(exchange <code>{escape(f.first.exchange_id)}</code>)."
        if f.first is not None
        else ""
    )
    return [
        f"<h2>Failures{of}</h2>",
        f'<div class="callout bad">{f.failed + f.breaker} of its {f.attempted} attempted legs failed '
        f"or were dropped with its breaker open. {first} Its speed, acceptance and quality are not "
        "analysed until it answers.</div>",
        _table(["legs", "count"], failure_rows(c)),
    ]


def _candidate_sections(
    a: Analysis, c: CandidateAnalysis, figs: Mapping[str, str | None]
) -> list[str]:
    """Speed, load, acceptance, quality and examples of one candidate; a failing candidate's
    failures instead (its speed, load and quality say nothing while it does not answer)."""
    of = f" — {escape(c.label)}" if a.several else ""
    if c.failing:
        return _failures_section(c, of)
    parts = [
        f"<h2>Speed: paired candidate-vs-primary speedups{of}</h2>",
        '<p class="muted">Per exchange ratio primary / candidate on the same request; geometric mean with a bootstrap 95 % interval. '
        "Above 1 means the candidate is faster. These are raw: at whatever load the candidate ran at (see the load section for the speed-up at production's load, which the verdict uses). "
        "The baseline column is the same comparison for a plain copy of the primary: it should sit at 1.</p>",
        _figure(figs.get(f"speedup:{c.backend}"), "Speedup per category with 95 % CI (colour = verdict)", "No paired primary/candidate exchanges."),
        _table(["category", "pairs", "e2e", "tpot", "ttft", "baseline e2e (noise)"], _speed_rows(a, c)),
        *_load_section(a, c, figs, of),
        f"<h2>Speculation: acceptance{of}</h2>",
        '<p class="muted"><b>Tokens per event</b> (from the stream shape) ≈ tokens per target pass — what buys latency. '
        "<b>Mean acceptance length</b> (the engine's count) counts only the steps where the proposer drafted; <b>coverage</b> is the share of passes that drafted at all. "
        "They are different quantities.</p>",
        _figure(figs.get(f"acceptance:{c.backend}"), "Candidate tokens per event (boxes) and mean acceptance length (diamonds)", "No candidate acceptance data."),
        _table(["group", "n", "tokens/event", "mean acceptance length", "draft acceptance rate", "coverage"], _acceptance_rows(c)),
        f"<h2>Quality: equivalence on sampled traffic{of}</h2>",
        '<p class="muted">Candidate and baseline (or, without one, the primary) answer the same prompts independently: a lossless candidate is exchangeable with it. '
        "Paired sign-flip permutation tests per metric and an MMD test on the outputs (string kernel), Holm-corrected; "
        "<b>equivalent</b> when every metric's 90 % interval lies inside its margin (TOST at 5 %), <b>not_equivalent</b> when a test rejects beyond the margin. "
        "Greedy exchanges are judged by exact match below.</p>",
        _table(EQUIVALENCE_HEAD, equivalence_rows(c, a.categories)),
        f"<h2>Quality: greedy exact match against the noise floor{of}</h2>",
        '<p class="muted">A candidate divergence rate means something only next to the baseline\'s (two plain copies of the primary also diverge: batching, kernels, numerics).</p>',
        _figure(figs.get(f"quality:{c.backend}"), "Share of exchanges not exactly equal to the primary, with Wilson 95 % CI", quality_empty(c)),
        _table(["category", "candidate diverges", "baseline diverges (noise)", "vs noise", "flagged (greedy)", "JSON valid", "JSON equal", "tool calls equal", "one-sided refusals", "similarity p50"], quality_rows(c, a.categories)),
    ]  # fmt: skip
    if c.examples:
        parts.append("<h3>Worst examples</h3>")
        for ex in c.examples:
            sim = "—" if ex.similarity is None else f"{ex.similarity:.3f}"
            parts.append(
                f"<p><b>{escape(ex.category)}</b> · exchange <code>{escape(ex.exchange_id)}</code> · similarity {sim} · "
                f"first divergence at {escape(str(ex.first_divergence))} {escape(str(ex.divergence_unit or ''))}</p>"
            )
            if ex.primary_text is not None or ex.candidate_text is not None:
                parts.append(
                    f"<pre>primary:   {escape((ex.primary_text or '')[:600])}\ncandidate: {escape((ex.candidate_text or '')[:600])}</pre>"
                )
            else:
                parts.append(
                    '<p class="muted">Text was not captured (capture policy off/hashes).</p>'
                )
    return parts


def _bottom_line(a: Analysis) -> list[str]:
    if not a.candidates:
        return []
    parts = ["<h2>Bottom line</h2>"]
    if a.several:
        head, rows = verdict_matrix(a)
        parts += [
            '<p class="muted">Every candidate judged on its own against the primary (verdict · e2e speed-up at production load, 95 % CI), '
            "and the configuration to ship per category.</p>",
            _table(head, rows),
        ]
    else:
        main = a.main
        assert main is not None
        # One block: a gloss for a term a card names goes after the row, never inside the grid.
        parts.append('<div class="cards">' + "".join(_card(v) for v in main.verdicts) + "</div>")
    parts += [
        "<h3>Recommendation</h3>",
        f'<p class="muted">{escape(RULE)}</p>',
        _table(["category", "ship", "why"], recommendation_rows(a), wrap=(2,)),
    ]
    if a.policy_fragment:
        parts += [
            "<p>Policy rules that keep each category on its pick (add them to the policy's <code>rules</code>; "
            "a rollout stage turns a rule live):</p>",
            f'<pre class="code">{escape(a.policy_fragment)}</pre>',  # to copy: never cut
        ]
    return parts


def quality_empty(c: CandidateAnalysis) -> str:
    """What stands in for the divergence chart when it would be empty or all zero."""
    q = c.quality.get(ALL)
    if q is None or not q.candidate_divergence.n:
        return "No comparisons recorded."
    cand, base = q.candidate_divergence, q.baseline_divergence
    floor = f"; baseline {base.k} of {base.n}" if base.n else ""
    return (
        f"{cand.k} of {cand.n} greedy outputs differ from the primary's{floor} — no chart: "
        "every bar would be zero."
    )


def head_to_head_empty(a: Analysis) -> str:
    """What stands in for the head-to-head chart: never "no request reached two candidates"
    beside a table of requests that did."""
    mirrored = max((h.mirrored for h in a.head_to_head if h.category == ALL), default=0)
    if not mirrored:
        return "No request reached two candidates."
    return (
        f"{mirrored} requests reached two candidates (the table below), but too few with both "
        "at production's load for a ratio with a confidence interval: no chart."
    )


def _glance(a: Analysis) -> list[str]:
    """The first screen: rollbacks, failing candidates and the fix first, then each verdict
    with what it rests on, what to ship, and the window."""
    lines = front(a)
    if not lines:
        return []
    parts = ['<section class="glance" id="at-a-glance">']
    callouts = ("rollback", "breach", "pick", "changed", "failing", "fix")
    for line in lines:
        if line.kind in callouts:
            cls = "warn" if line.kind in ("fix", "changed", "pick") else "bad"
            parts.append(
                f'<div class="callout {cls}"><b>{escape(line.title)}</b> — {escape(line.text)}</div>'
            )
    rest = [line for line in lines if line.kind not in callouts]
    items = "".join(f"<li><b>{escape(x.title)}</b> — {escape(x.text)}</li>" for x in rest)
    parts += [f"<ul>{items}</ul>", "</section>"]
    return ["\n".join(parts)]


_H2 = re.compile(r"<h2>(.*?)</h2>", re.S)
_TAGS = re.compile(r"<[^>]+>")


def _with_contents(parts: Sequence[str]) -> list[str]:
    """Every ``<h2>`` gets an id; a table of contents links them, after the first screen."""
    seen: dict[str, int] = {}
    entries: list[str] = []

    def anchor(m: re.Match[str]) -> str:
        text = _TAGS.sub("", m.group(1))
        base = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"
        seen[base] = seen.get(base, 0) + 1
        ident = base if seen[base] == 1 else f"{base}-{seen[base]}"
        entries.append(f'<li><a href="#{ident}">{m.group(1)}</a></li>')
        return f'<h2 id="{ident}">{m.group(1)}</h2>'

    out = [_H2.sub(anchor, p) for p in parts]
    nav = f'<nav class="toc"><b>Contents</b><ol>{"".join(entries)}</ol></nav>'
    return [nav if p == _TOC else p for p in out]


_TOC = "<!-- contents -->"


def _gloss(parts: Sequence[str]) -> list[str]:
    def text(part: str) -> str:
        return _TAGS.sub(" ", re.sub(r'\s(alt|src|href)="[^"]*"', "", part))

    return first_use(
        parts,
        text,
        lambda term, meaning: f'<p class="gloss"><b>{escape(term)}</b>: {escape(meaning)}</p>',
        skip=lambda p: p.startswith(
            ("<!doctype", "<meta", "<h1", "<h2", "<h3", '<p class="sub"', "<nav")
        ),
    )


def _workflows(a: Analysis) -> list[str]:
    """Where calls form application runs, the run's projected speed-up per workflow type."""
    w = a.workflows
    if w is None or not w.types:
        return []
    return [
        f"<h2>{escape(wv.TITLE)}</h2>",
        f'<p class="muted">{escape(wv.intro(w))}</p>',
        _table(wv.HEAD, wv.rows(w), wrap=(9,)),
    ]


def render_html(
    a: Analysis, figs: Mapping[str, str | None], *, title: str, sources: Sequence[str]
) -> str:
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    cls, gate = gate_text(a)
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>',
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_CSS}</style></head><body><main>',
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub">Generated {generated} from {escape(", ".join(sources) or "no inputs")} · '
        f"{a.records} comparison records"
        + (f" (detail sections: a sample of {a.sample})" if a.sample else "")
        + f" · categories: {escape(', '.join(a.categories) or '—')}</p>",
        *_glance(a),
        _TOC,
        *_workflows(a),
        *_bottom_line(a),
    ]  # fmt: skip
    if a.candidates:
        parts += [
            "<h2>Candidates</h2>",
            '<p class="muted">What each candidate runs, as the policy declares it and as the backend reports it '
            "(vLLM <code>/server_info</code>, SGLang <code>/get_server_info</code>). A candidate is called lossless only when "
            "its verification mode is reported lossless <i>and</i> its outputs sit within the noise floor; a lossy mode is never called lossless.</p>",
            _table(CAND_HEAD, candidate_rows(a), wrap=(4, 6, 7)),
        ]  # fmt: skip
    if a.several:
        parts += [
            "<h2>Head to head: candidates on the same requests</h2>",
            '<p class="muted">Every request mirrored to two candidates is a paired comparison between them: ratio of their e2e (and tpot), '
            "geometric mean with a bootstrap 95 % interval, counting only requests where both ran at production's load (load parity within the band). "
            "A CI that excludes 1 makes “B beats A on this category” a measured statement.</p>",
            _figure(figs.get("head_to_head"), "e2e ratio per pair and category, 95 % CI (green: the first named is faster)", head_to_head_empty(a)),
            _table(["category", "pair", "e2e ratio", "tpot ratio", "pairs at load / mirrored", "result"], head_to_head_rows(a)),
            _figure(figs.get("speedup_vs_load"), "Speed-up against each candidate's per-replica arrival rate, 95 % CI; shaded: production's operating range (p5–p95)",
                    "No pairs at a known load: no speed-up against load."),
        ]  # fmt: skip
    parts += [
        "<h2>Decision gate: is generation the bottleneck?</h2>",
        f'<div class="callout {cls}">{escape(gate)}</div>',
        _figure(figs.get("gate"), "Median split of primary response time: waiting for the first token vs generating; dashed line at 50 %", "No timing data for the gate."),
    ]  # fmt: skip
    if a.records:
        for c in a.candidates.values():
            parts += _candidate_sections(a, c, figs)
        parts += [
            "<h2>Latency per leg and category (ms)</h2>",
            _figure(figs.get("latency"), "p50 (bars) and p99 (ticks) per leg", "No latency data."),
            _table(_LAT_HEAD, _latency_rows(a)),
        ]
    parts += _counterfactual_section(a, figs)
    if a.rollout:
        parts += [
            "<h2>Rollout</h2>",
            '<p class="muted">The stages the records went through, per rule, in time order. A canary followed by '
            "shadow is a rollback (who and why: <code>GET /admin/rollout</code>, the gateway's log, "
            "<code>specshadow_rollout_transitions_total</code>).</p>",
            _table(["rule", "stage", "from", "to", "exchanges", "answered by the candidate", "failovers"],
                   rollout_rows(a)),
            *(f'<div class="callout bad">Rule {escape(rb.rule)}: {escape(rb.text())}.</div>'
              for rb in a.rollbacks),
        ]  # fmt: skip
    parts += _tail(a, figs)
    parts.append("</main></body></html>")
    return "\n".join(_with_contents(_gloss(parts)))


def counterfactual_rows(a: Analysis) -> tuple[list[list[str]], list[list[str]]]:
    """(picks per category, live candidates predicted vs measured) of the counterfactual matrix."""
    m = a.counterfactual
    if m is None:
        return [], []
    picks = []
    for cat, pick in sorted(m.picks.items(), key=lambda kv: (kv[0] == ALL, kv[0])):
        if pick["config"] is None:
            picks.append([cat, "none", "–", "–", pick["reason"]])
            continue
        mal, speed = pick["mean_acceptance_length"], pick["predicted_tpot_speedup"] or {}
        picks.append([
            cat, pick["config"]["label"], _interval3(mal),
            _interval3(speed) + ("×" if speed.get("estimate") is not None else ""),
            f"runner-up: {pick['runner_up']}" if pick["runner_up"] else "",
        ])  # fmt: skip
    live = [
        [
            x["backend"], x["label"], _interval3(x["predicted_mean_acceptance_length"]),
            _interval3(x["measured_mean_acceptance_length"]),
            _interval3((x.get("engine_check") or {}).get("predicted_mean_acceptance_length")),
            ("⚠ " if x["flag"] else "") + x["note"],
        ]
        for x in m.live
    ]  # fmt: skip
    return picks, live


def _interval3(obj: Mapping[str, Any] | None) -> str:
    if not obj or obj.get("estimate") is None:
        return "–"
    if obj.get("low") is None:
        return f"{obj['estimate']:.2f}"
    return f"{obj['estimate']:.2f} [{obj['low']:.2f}, {obj['high']:.2f}]"


def _counterfactual_section(a: Analysis, figs: Mapping[str, str | None]) -> list[str]:
    m = a.counterfactual
    if m is None:
        return []
    picks, live = counterfactual_rows(a)
    model = m.model
    fit = (
        f"Step-time model: {model.base_s * 1e3:.3f} ms + {model.slot_s * 1e3:.4f} ms × batch × "
        f"(1 + drafted per pass) at production's batch {model.batch:.1f} ({model.points} legs; {model.note})."
        if model is not None
        else "No leg carried TPOT and batch: configurations are ranked by tokens per pass."
    )
    parts = [
        "<h2>Counterfactual: every proposer and depth on production's own outputs</h2>",
        f'<p class="muted">{m.scored} exchanges carried token ids; each was replayed under {len(m.configs)} '
        "configurations (vLLM's n-gram proposer at every depth and lookup window, and every drafter). Acceptance is exact "
        "for greedy requests and an exact draw for sampled ones; speed-ups are <b>predicted</b> from a step-time model "
        f"fitted to the legs, never measured. {escape(fit)} Every row: <code>counterfactual.json</code>; the policy fragment "
        "for the picks: <code>candidates.yaml</code>.</p>",
        _table(["category", "pick", "mean acceptance length", "predicted TPOT speed-up", ""], picks),
        _figure(figs.get("counterfactual"), "Predicted mean acceptance length against k (95 % CI), all traffic; ★: a live candidate's measured value",
                "No configuration drafted."),
    ]  # fmt: skip
    if live:
        parts += [
            "<h3>Predicted against measured: live candidates</h3>",
            '<p class="muted">A live candidate running a scored configuration, on the same requests: the prediction from '
            "production's outputs, what its engine reported, and the configuration replayed on the candidate's own output "
            "(exact per request: a gap there means the engine does not run what it declares).</p>",
            _table(["backend", "configuration", "predicted", "measured", "replayed on its own output", ""], live, wrap=(5,)),
        ]  # fmt: skip
    skipped = "; ".join(f"{escape(b)}: {escape(why)}" for b, why in sorted(m.live_skipped.items()))
    if skipped:  # an empty check is said, with its reason
        parts.append(f'<p class="muted">No live check against the prediction for {skipped}.</p>')
    return parts + _counterfactual_detail(m)


def _counterfactual_detail(m: Matrix) -> list[str]:
    """Dynamic lookahead rules against fixed k, where drafts are rejected, acceptance by
    position in the output and a drafter vocabulary's misses (counterfactual.render's tables)."""
    from counterfactual.render import (
        positions_table,
        rejections_table,
        rules_table,
        vocabulary_table,
    )

    parts: list[str] = []
    head, rows = rules_table(m)
    if rows:
        parts += [
            "<h3>Dynamic lookahead against the best fixed k</h3>",
            '<p class="muted">Rules that choose the draft length step by step, replayed on the same outputs; each row says '
            "whether its replay is exact, exact given the drafter, or a bound (docs/counterfactual.md).</p>",
            _table(head, rows),
        ]  # fmt: skip
    for title, (head, rows) in (
        ("Where drafts are rejected (each category's pick)", rejections_table(m)),
        ("Acceptance by position in the output", positions_table(m)),
        ("Outside the declared drafter vocabulary", vocabulary_table(m)),
    ):
        if rows:
            parts += [f"<h3>{escape(title)}</h3>", _table(head, rows)]
    return parts


def _tail(a: Analysis, figs: Mapping[str, str | None]) -> list[str]:
    """Memory, the benchmark matrix, client-side results, the checklist and the definitions."""
    parts = ["<h2>Memory and utilisation</h2>"]
    if a.resources:
        parts.append(_table(["backend", "KV-cache usage peak", "mean", "samples"], [
            [b, _pct(r.peak), _pct(r.mean), str(r.samples)] for b, r in sorted(a.resources.items())
        ]))  # fmt: skip
    else:
        parts.append(
            '<p class="muted">No backend exposed memory or utilisation (e.g. <code>vllm:kv_cache_usage_perc</code>).</p>'
        )
    if a.matrix:
        regions = (
            "".join(f"<li>{escape(line)}</li>" for line in a.stable_regions)
            or "<li>none: no backend's speedup CI stays above 1 across neighbouring concurrencies</li>"
        )
        parts += [
            "<h2>Benchmark matrix: the stable operating region</h2>",
            f"<div class=\"callout\"><b>Stable region</b> (speedup CI &gt; 1 here and at the neighbouring concurrencies):<ul>{regions}</ul></div>",
            _figure(figs.get("matrix_speedup"), "e2e speedup vs concurrency per backend (band: 95 % CI; filled: stable)", "No paired matrix cells."),
            _figure(figs.get("matrix_acceptance"), "Tokens per event vs concurrency", "No tokens-per-event data in the matrix."),
            _table(["backend", "proposer", "depth", "bucket", "conc.", "ok", "ttft p50", "tpot p50", "e2e p99", "tok/event", "goodput", "e2e speedup [95 % CI]", "stable"], _matrix_rows(a.matrix)),
        ]  # fmt: skip
    if a.loadgen:
        parts += [
            "<h2>Client-side load test</h2>",
            _table(
                ["category", "ok", "ttft p50", "p99", "tpot p50", "p99", "e2e p50", "p99"],
                _loadgen_rows(a.loadgen),
            ),
        ]
    if a.checklist:
        items = "".join(f"<li>{escape(i)}</li>" for i in a.checklist)
        parts += [
            "<h2>Release checklist and rollback triggers</h2>",
            f'<ol class="check">{items}</ol>',
            '<p class="muted">The same triggers as code, next to this report when a configuration is recommended: '
            "<code>rollout.yaml</code> (policy rules with a canary and these guards), "
            "<code>argo-analysis-template.yaml</code> and <code>flagger-metric-templates.yaml</code> (the guards as PromQL).</p>",
        ]  # fmt: skip
    parts.append(
        '<h2>Definitions</h2><p class="muted">ttft: request sent → first output-bearing event. '
        "tpot: (e2e − ttft)/(output tokens − 1) = vLLM TPOT = AIPerf/GuideLLM ITL. chunk gap: gaps between output-bearing events = vLLM ITL = AIPerf ICL. "
        "e2e: request sent → last output-bearing event = vLLM E2EL. tokens per event: output tokens / output-bearing events (no peer reports it).</p>"
    )
    return parts
