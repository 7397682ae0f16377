"""Records → the counterfactual matrix: one row per configuration × category × output length.

Every record that carries ``tokens`` (the token tap's ids, docs/records.md) is replayed under
every configuration of the grid (:mod:`.grid`, :mod:`.replay`); per cell the counts are pooled
as ratios of sums — mean acceptance length ``1 + Σaccepted / Σdrafts`` (vLLM's definition),
tokens per pass ``Σoutput / Σpasses`` — with delta-method 95 % intervals over requests (the
request is the unit: its steps are not independent). Memory is bounded by the grid, not by the
store: records stream through twice (once to learn which live configurations and drafters there
are, once to score), and only sums are kept.

Beside the matrix: the step-time model fitted on every record's legs (:mod:`.speed`) turns
acceptance into a *predicted* TPOT speed-up at production's batch; the picks per category; and,
for each live candidate running a configuration of the grid, predicted against measured
acceptance on the same requests, flagged when the intervals do not overlap.

Size: the two passes over the records, the cells they fill and the rows, picks and live checks
made from those cells share one set of types; split apart, each piece would re-read the others'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.classify import ALL
from core.stats import RatioStats, paired_ratio_test
from counterfactual.grid import DEFAULT_DEPTHS, DEFAULT_WINDOWS, Config, grid
from counterfactual.replay import Replay, drafter_offers, ngram_offers, replay
from counterfactual.speed import StepModel, fit_step_model, leg_batch
from records.reader import Leg, Record, read
from records.rules import output_length_bucket

__all__ = ["ALL", "Matrix", "build_matrix", "live_config", "request_json"]

# A record as stored (a JSON object) or already read; every field is read through the reader.
AnyRecord = Mapping[str, Any] | Record


@dataclass(slots=True)
class Cell:
    """One configuration × category × output-length bucket."""

    k: int
    mal: RatioStats = field(default_factory=RatioStats)  # x: drafts, y: accepted
    tpp: RatioStats = field(default_factory=RatioStats)  # x: passes, y: output tokens
    draft_tokens: int = 0
    by_position: list[int] = field(default_factory=list)
    greedy: int = 0

    def add(self, r: Replay, greedy: bool) -> None:
        self.mal.add(r.drafts, r.accepted)
        self.tpp.add(r.passes, r.output_tokens)
        self.draft_tokens += r.draft_tokens
        if not self.by_position:
            self.by_position = [0] * self.k
        for i, v in enumerate(r.accepted_by_position):
            self.by_position[i] += v
        self.greedy += greedy


@dataclass(slots=True)
class LiveCheck:
    """A live candidate running a scored configuration: predicted vs measured, same requests."""

    backend: str
    config: Config
    predicted: RatioStats = field(default_factory=RatioStats)
    measured: RatioStats = field(default_factory=RatioStats)
    # The same split by greedy / sampled: exact per request on greedy traffic (the candidate's
    # output is production's), equal only in expectation on sampled traffic.
    by_kind: dict[str, tuple[RatioStats, RatioStats]] = field(default_factory=dict)
    # Sampled requests one by one — (predicted drafts, accepted, measured drafts, accepted) — for
    # the paired test that judges them (see :func:`_compare`).
    sampled_pairs: list[tuple[float, float, float, float]] = field(default_factory=list)
    # The engine check: the configuration replayed on the candidate's *own* generated ids
    # against what it reported — exact per request, greedy or sampled, when the ids are there.
    engine: tuple[RatioStats, RatioStats] = field(
        default_factory=lambda: (RatioStats(), RatioStats())
    )

    def add(self, greedy: bool, predicted: Replay, drafts: float, accepted: float) -> None:
        pair = self.by_kind.setdefault(
            "greedy" if greedy else "sampled", (RatioStats(), RatioStats())
        )
        for target in (self.predicted, pair[0]):
            target.add(predicted.drafts, predicted.accepted)
        for target in (self.measured, pair[1]):
            target.add(drafts, accepted)
        if not greedy:
            self.sampled_pairs.append((predicted.drafts, predicted.accepted, drafts, accepted))


@dataclass(frozen=True, slots=True)
class Matrix:
    rows: list[dict[str, Any]]
    picks: dict[str, dict[str, Any]]  # category → the configuration to deploy for it
    deploy: list[Config]  # the one or two configurations worth deploying as live candidates
    live: list[dict[str, Any]]
    model: StepModel | None
    records: int  # records read
    scored: int  # records with tokens, replayed
    configs: tuple[Config, ...]

    def as_json(self) -> dict[str, Any]:
        """The summary (``counterfactual_summary.json``); the rows are ``counterfactual.json``."""
        return {
            "schema": "specshadow.counterfactual/1",
            "records": self.records,
            "scored": self.scored,
            "step_model": self.model.as_json() if self.model is not None else None,
            "picks": self.picks,
            "deploy": [config_json(c) for c in self.deploy],
            "live": self.live,
        }


def request_json(
    record: AnyRecord, category: str, bucket: str, greedy: bool, results: Mapping[Config, Replay]
) -> dict[str, Any]:
    """One record's replay under every configuration: its mean acceptance length, acceptance rate
    per draft position, and the counts behind them."""
    return {
        "exchange_id": read(record).exchange_id,
        "category": category,
        "output_length_bucket": bucket,
        "greedy": greedy,
        "configs": {
            c.label: {
                "mean_acceptance_length": r.mean_acceptance_length,
                "acceptance_by_position": [v / r.drafts for v in r.accepted_by_position]
                if r.drafts
                else None,
                "drafts": r.drafts,
                "draft_tokens": r.draft_tokens,
                "accepted": r.accepted,
                "passes": r.passes,
                "output_tokens": r.output_tokens,
            }
            for c, r in results.items()
        },
    }


def config_json(c: Config) -> dict[str, Any]:
    return {
        "proposer": c.proposer,
        "num_speculative_tokens": c.num_speculative_tokens,
        "prompt_lookup_min": c.prompt_lookup_min,
        "prompt_lookup_max": c.prompt_lookup_max,
        "drafter": c.drafter,
        "label": c.label,
    }


def live_config(leg: Leg | Mapping[str, Any]) -> Config | None:
    """The configuration a candidate leg's backend runs, when it is one the replay can score."""
    spec = (leg if isinstance(leg, Leg) else Leg(leg)).speculative
    if spec is None:
        return None
    method = (spec.method or "").lower().replace("-", "").replace("_", "")
    k = spec.num_speculative_tokens
    if k is None or k < 1:
        return None
    lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
    if method in ("ngram", "promptlookup") and lo is not None and hi is not None:
        return Config("ngram", k, lo, hi)
    return None


def _tokens(record: Record) -> tuple[list[int], list[int], Mapping[str, list[int]]] | None:
    """(prompt ids, output ids, each drafter's predicted ids); None unless both ids are there."""
    t = record.tokens
    if t is None:
        return None
    prompt, output = t.prompt, t.output
    if prompt is None or not output:
        return None
    return prompt, output, t.drafters


def _speed_points(record: Record) -> Iterable[tuple[str, float, float, float]]:
    """(role, batch, slots per sequence, step seconds) for each completed leg that tells
    (:attr:`Leg.ok`: the completed-leg rule every reader of the records shares)."""
    for leg in record.legs:
        if not leg.ok:
            continue
        tpot, batch, out = leg.tpot_s, leg_batch(leg), leg.output_tokens
        if tpot is None or batch is None or out is None or out < 2:
            continue
        spec = leg.speculative
        k = spec.num_speculative_tokens if spec is not None else None
        if leg.role == "primary" and not k:
            yield "primary", batch, 1.0, tpot
            continue
        tpp, drafted = leg.acceptance.tokens_per_pass, leg.acceptance.num_draft_tokens
        if leg.role == "candidate" and tpp and drafted is not None:
            passes = out / tpp
            yield "candidate", batch, 1.0 + drafted / passes, tpot * tpp


def build_matrix(
    open_records: Callable[[], Iterable[AnyRecord]],
    *,
    depths: tuple[int, ...] = DEFAULT_DEPTHS,
    windows: tuple[tuple[int, int], ...] = DEFAULT_WINDOWS,
    per_request: Callable[[dict[str, Any]], None] | None = None,
) -> Matrix:
    """Score the grid on every record with tokens; ``open_records`` is called twice.

    ``per_request`` receives, for every scored record, its replay under every configuration
    (:func:`request_json`) — streamed, never kept.
    """
    live: set[Config] = set()
    drafter_names: set[str] = set()
    for record in map(read, open_records()):
        for leg in record.legs:
            if leg.role == "candidate":
                c = live_config(leg)
                if c is not None:
                    live.add(c)
        tok = _tokens(record)
        if tok is not None:
            drafter_names.update(tok[2])
    configs = grid(depths=depths, windows=windows, drafters=sorted(drafter_names), extra=live)
    max_k = max(c.num_speculative_tokens for c in configs)
    families: dict[tuple[Any, ...], list[Config]] = {}
    for c in configs:
        families.setdefault(c.family, []).append(c)

    cells: dict[tuple[Config, str, str], Cell] = {}
    checks: dict[tuple[str, Config], LiveCheck] = {}
    points: list[tuple[float, float, float]] = []
    primary_batches: list[float] = []
    records = scored = 0
    for record in map(read, open_records()):
        records += 1
        for role, b, slots, step in _speed_points(record):
            points.append((b, slots, step))
            if role == "primary":
                primary_batches.append(b)
        tok = _tokens(record)
        if tok is None:
            continue
        scored += 1
        prompt, output, drafted = tok
        category = record.category
        bucket = output_length_bucket(len(output)) or "unknown"
        greedy = record.greedy
        results: dict[Config, Replay] = {}
        for family, members in families.items():
            proposer, lo, hi, drafter = family
            if proposer == "ngram" and lo is not None and hi is not None:
                available, match = ngram_offers(prompt, output, lo, hi, max_k)
            else:
                predicted = drafted.get(drafter or "")  # the reader's {drafter: ids}
                if predicted is None or len(predicted) != len(output):
                    continue
                available, match = drafter_offers(output, predicted)
            for c in members:
                results[c] = replay(len(output), c.num_speculative_tokens, available, match)
        if per_request is not None:
            per_request(request_json(record, category, bucket, greedy, results))
        for c, r in results.items():
            for cat in (category, ALL):
                for bk in (bucket, ALL):
                    cell = cells.setdefault((c, cat, bk), Cell(c.num_speculative_tokens))
                    cell.add(r, greedy)
        own_ids = record.tokens.legs if record.tokens is not None else {}
        for leg in record.legs:
            if leg.role != "candidate":
                continue
            c = live_config(leg)
            drafts = leg.acceptance.num_drafts
            accepted = leg.acceptance.num_accepted_tokens
            if c is None or c not in results or drafts is None or accepted is None:
                continue
            check = checks.setdefault((leg.backend, c), LiveCheck(leg.backend, c))
            check.add(greedy, results[c], drafts, accepted)
            own = own_ids.get(check.backend) or None  # the reader's {backend: generated ids}
            if (
                own is not None
                and c.proposer == "ngram"
                and c.prompt_lookup_min
                and c.prompt_lookup_max
            ):
                offers = ngram_offers(prompt, own, c.prompt_lookup_min, c.prompt_lookup_max, max_k)
                mine = replay(len(own), c.num_speculative_tokens, *offers)
                check.engine[0].add(mine.drafts, mine.accepted)
                check.engine[1].add(drafts, accepted)

    model = fit_step_model(points, primary_batches)
    rows = [
        _row(c, cat, bk, cell, model) for (c, cat, bk), cell in sorted(cells.items(), key=_order)
    ]
    picks = _picks(rows, configs)
    deploy = _deploy(picks, configs)
    return Matrix(
        rows=rows,
        picks=picks,
        deploy=deploy,
        live=[_live_json(ch) for ch in checks.values()],
        model=model,
        records=records,
        scored=scored,
        configs=configs,
    )


def _order(item: tuple[tuple[Config, str, str], Cell]) -> tuple[Any, ...]:
    (c, cat, bk), _ = item
    return (
        cat != ALL,
        cat,
        bk != ALL,
        bk,
        c.family[0],
        str(c.family[1:]),
        c.num_speculative_tokens,
    )


def _interval_json(stats: RatioStats, offset: float = 0.0) -> dict[str, Any]:
    est, ci = stats.estimate(), stats.interval()
    return {
        "estimate": None if est is None else est + offset,
        "low": None if ci is None else ci[0] + offset,
        "high": None if ci is None else ci[1] + offset,
        "n": stats.n,
    }


def _row(
    c: Config, category: str, bucket: str, cell: Cell, model: StepModel | None
) -> dict[str, Any]:
    drafts = cell.mal.sx
    tpp = cell.tpp.estimate()
    tpp_ci = cell.tpp.interval()
    passes = cell.tpp.sx
    drafted_per_pass = cell.draft_tokens / passes if passes else 0.0
    speedup: float | None = None
    interval: dict[str, Any] | None = None
    if model is not None and tpp is not None:
        speedup = model.speedup(tpp, drafted_per_pass)
        if tpp_ci is not None:
            lo, hi = (model.speedup(v, drafted_per_pass) for v in tpp_ci)
            interval = {"low": lo, "high": hi}
    return {
        **config_json(c),
        "category": category,
        "output_length_bucket": bucket,
        "requests": cell.mal.n,
        "greedy_requests": cell.greedy,
        "mean_acceptance_length": _interval_json(cell.mal, 1.0),
        "draft_acceptance_rate": cell.mal.sy / cell.draft_tokens if cell.draft_tokens else None,
        "acceptance_by_position": [v / drafts if drafts else None for v in cell.by_position]
        or [None] * c.num_speculative_tokens,
        "tokens_per_pass": _interval_json(cell.tpp),
        "drafted_per_pass": drafted_per_pass,
        # Predicted, never measured: tokens per pass through the fitted step-time model.
        "predicted_tpot_speedup": speedup,
        "predicted_tpot_speedup_interval": interval,
    }


def _score(row: Mapping[str, Any]) -> float:
    # ``row``: one of the matrix's own output rows (:func:`_row`), not a record.
    value = row.get("predicted_tpot_speedup")
    if value is None:
        value = (row.get("tokens_per_pass") or {}).get("estimate")
    return float(value) if value is not None else -math.inf


def _picks(rows: list[dict[str, Any]], configs: tuple[Config, ...]) -> dict[str, dict[str, Any]]:
    """Per category (all output lengths): the best-scoring configuration and the runner-up of
    another proposer family — or none, when no configuration is predicted to beat plain decoding
    (nothing to draft from, or drafts that cost more than they save)."""
    best: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["output_length_bucket"] == ALL:
            best.setdefault(row["category"], []).append(row)
    out: dict[str, dict[str, Any]] = {}
    for cat, candidates in best.items():
        ranked = sorted(candidates, key=_score, reverse=True)
        top = ranked[0]
        pays = _score(top) > 1.0 and (top["mean_acceptance_length"]["estimate"] or 1.0) > 1.0
        runner = next((r for r in ranked[1:] if _family(r) != _family(top)), None)
        out[cat] = {
            "config": {k: top[k] for k in _CONFIG_KEYS} if pays else None,
            "predicted_tpot_speedup": _speedup_json(top) if pays else None,
            "mean_acceptance_length": top["mean_acceptance_length"] if pays else None,
            "runner_up": runner["label"] if pays and runner is not None else None,
            "ranking": [r["label"] for r in ranked[:5]] if pays else [],
            "reason": None if pays else "no configuration is predicted to beat plain decoding",
        }
    return out


def _speedup_json(row: Mapping[str, Any]) -> dict[str, Any] | None:
    # ``row``: one of the matrix's own output rows (:func:`_row`), not a record.
    if row.get("predicted_tpot_speedup") is None:
        return None
    interval = row.get("predicted_tpot_speedup_interval") or {}
    return {
        "estimate": row["predicted_tpot_speedup"],
        "low": interval.get("low"),
        "high": interval.get("high"),
        "kind": "predicted",
    }


_CONFIG_KEYS = (
    "proposer",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "drafter",
    "label",
)


def _family(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return (row["proposer"], row["prompt_lookup_min"], row["prompt_lookup_max"], row["drafter"])


def _deploy(picks: Mapping[str, Mapping[str, Any]], configs: tuple[Config, ...]) -> list[Config]:
    """The overall pick, and a second configuration that some category prefers, if any."""
    by_label = {c.label: c for c in configs}
    order: list[Config] = []
    overall = picks.get(ALL)
    if overall is not None and overall["config"] is not None:
        order.append(by_label[overall["config"]["label"]])
    for cat, pick in sorted(picks.items()):
        if cat == ALL or pick["config"] is None:
            continue
        c = by_label[pick["config"]["label"]]
        if c not in order:
            order.append(c)
    return order[:2]


def _live_json(check: LiveCheck) -> dict[str, Any]:
    out = {
        "backend": check.backend,
        **config_json(check.config),
        **_compare(check.predicted, check.measured),
    }
    for kind in ("greedy", "sampled"):
        pair = check.by_kind.get(kind)
        out[kind] = (
            None
            if pair is None
            else _compare(*pair, paired=check.sampled_pairs if kind == "sampled" else None)
        )
    # The pooled figures mix exact (greedy) and in-expectation (sampled) agreement: the flag is
    # each kind's own rule's.
    flagged = [
        kind for kind in ("greedy", "sampled") if out[kind] is not None and out[kind]["flag"]
    ]
    out["flag"] = bool(flagged)
    out["note"] = (
        f"{' and '.join(flagged)} requests: " + " / ".join(out[k]["note"] for k in flagged)
        if flagged
        else "predicted and measured agree on every kind of request"
    )
    out["engine_check"] = _compare(*check.engine) if check.engine[0].n else None
    sampled = out["sampled"]
    engine = out["engine_check"]
    if engine is not None and not engine["flag"] and sampled is not None and sampled["flag"]:
        # Exact on the candidate's own output: what differs is the answers, not the replay.
        more = (sampled["relative_gap"] or 0.0) < 0
        out["note"] = sampled["note"] = (
            f"sampled requests: the candidate's own answers repeated {'more' if more else 'less'}"
            f" than production's (p = {sampled['p_value']:.3g}); the engine check passed (the "
            "replay is exact on the candidate's own output), so the difference is in what it "
            "answered — see the quality section"
        )
    if out["engine_check"] is not None and out["engine_check"]["flag"]:
        out["flag"] = True
        out["note"] = (
            "replayed on the candidate's own output, the configuration predicts acceptance its "
            "engine did not report: the engine does not run what it declares"
        )
    return out


SAMPLED_ALPHA = 0.01  # the sampled requests' paired test's false-alarm rate


def _compare(
    predicted_stats: RatioStats,
    measured_stats: RatioStats,
    paired: list[tuple[float, float, float, float]] | None = None,
) -> dict[str, Any]:
    """Predicted against measured. Exact per request (greedy, the engine check): the flag is two
    95 % intervals that do not overlap. Sampled (``paired``): the candidate answered other draws
    than production's, so agreement holds only in expectation and per-request acceptance is
    mostly zero with a few large values — a delta-method interval there can have no width at all
    (48 requests, none accepted anything). The flag is then a paired sign-flip permutation test
    (:func:`core.stats.paired_ratio_test`) at ``SAMPLED_ALPHA``."""
    predicted = _interval_json(predicted_stats, 1.0)
    measured = _interval_json(measured_stats, 1.0)
    gap = None
    if predicted["estimate"] is not None and measured["estimate"] is not None:
        gap = predicted["estimate"] / measured["estimate"] - 1.0
    out: dict[str, Any] = {
        "predicted_mean_acceptance_length": predicted,
        "measured_mean_acceptance_length": measured,
        "relative_gap": gap,
    }
    if paired is not None:
        p = paired_ratio_test(paired)
        flag = p is not None and p < SAMPLED_ALPHA
        out["p_value"] = p
        out["flag"] = flag
        out["note"] = (
            f"predicted and measured differ (paired permutation test, p = {p:.3g} < "
            f"{SAMPLED_ALPHA}): the replay is wrong for this traffic, or the engine does not run "
            "what it declares"
            if flag and p is not None
            else "predicted and measured agree in expectation (paired permutation test, p "
            + ("n/a" if p is None else f"= {p:.3g}")
            + ")"
        )
        return out
    disjoint = (
        None
        if None in (predicted["low"], predicted["high"], measured["low"], measured["high"])
        else predicted["high"] < measured["low"] or measured["high"] < predicted["low"]
    )
    out["flag"] = bool(disjoint)
    out["note"] = (
        "predicted and measured intervals do not overlap: the replay is wrong for this "
        "traffic, or the engine does not run what it declares"
        if disjoint
        else "predicted and measured agree within their intervals"
    )
    return out
