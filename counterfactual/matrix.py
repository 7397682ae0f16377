"""Records → the counterfactual matrix: one row per configuration × category × output length.

Every record that carries ``tokens`` (the token tap's ids, docs/records.md) is replayed under
every configuration of the grid (:mod:`.grid`, :mod:`.replay`); per cell the counts are pooled
as ratios of sums — mean acceptance length ``1 + Σaccepted / Σdrafts`` (vLLM's definition),
tokens per pass ``Σoutput / Σpasses`` — with delta-method 95 % intervals over requests (the
request is the unit: its steps are not independent). Memory is bounded by the grid, not by the
store: records stream through twice (once to learn which live configurations and drafters there
are, once to score), and only sums are kept.

Beside fixed k, every family is scored under the dynamic lookahead rules (:mod:`.rules`; a
batch-size schedule as a bound between fixed-k rows); each row says its replay class. With token
texts, each step's first rejected position is classified (:mod:`.rejections`); steps are split by
where in the output they started; a declared drafter vocabulary's misses are counted.

Beside the matrix: the step-time model fitted on every record's legs (:mod:`.speed`) turns
acceptance into a *predicted* TPOT speed-up at production's batch; the picks per category; and,
for each live candidate running a configuration of the grid, predicted against measured
acceptance on the same requests, flagged when the intervals do not overlap.

Size: the two passes over the records (the grid learned, then every record replayed under every
configuration, its rejections classified and its live legs paired) and the picks made from the
rows are one flow; the cells and rows (:mod:`.rows`) and the live check (:mod:`.live`) are apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.classify import ALL
from counterfactual.crossvocab import slem_offers, tli_replay
from counterfactual.grid import (
    DEFAULT_DEPTHS,
    DEFAULT_WINDOWS,
    Config,
    config_json,
    grid,
    llamacpp_config,
    sort_key,
)
from counterfactual.live import LiveCheck, agrees, baseline_agrees, live_json
from counterfactual.llamacpp_ngram import LlamaKnobs, LlamaServer
from counterfactual.llamacpp_replay import LlamaLiveCheck, feed_live, live_knobs
from counterfactual.rejections import classify_output, shares
from counterfactual.replay import (
    Replay,
    confidence_offers,
    drafter_offers,
    ngram_offers,
    replay,
)
from counterfactual.rows import Cell, bound_row, row as make_row
from counterfactual.rules import DEFAULT_RULES, DRAFTER_RULES, Rule, how_to_run
from counterfactual.speed import StepModel, fit_step_model, leg_batch
from counterfactual.suffix_replay import SuffixKnobs, suffix_offers
from records.reader import Leg, Record, read
from records.rules import output_length_bucket

if TYPE_CHECKING:
    from counterfactual.crossvocab_drafter import CrossVocabScores

__all__ = ["ALL", "Matrix", "build_matrix", "config_json", "live_config", "request_json"]

# A record as stored (a JSON object) or already read; every field is read through the reader.
AnyRecord = Mapping[str, Any] | Record


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
    # Per category: the output tokens' classes (None: no token texts), and the tokens outside a
    # declared drafter vocabulary (None: none declared).
    output_classes: dict[str, dict[str, int]] | None = None
    out_of_vocabulary: dict[str, Any] | None = None
    # Candidates with no live check, and why (never an empty ``live`` without a word).
    live_skipped: dict[str, str] = field(default_factory=dict)
    # llama.cpp n-gram candidates: per-request drafted/accepted against their timings.
    live_llamacpp: list[dict[str, Any]] = field(default_factory=list)
    # Cross-vocabulary drafters (--cross-vocab): per drafter, its intersection, what it was
    # asked, and per category the output tokens outside the intersection and, per depth, the
    # TLI rejections that were rejections by construction.
    cross_vocabulary: list[dict[str, Any]] = field(default_factory=list)

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
            "live_llamacpp": self.live_llamacpp,
            "live_skipped": [
                {"backend": b, "reason": r} for b, r in sorted(self.live_skipped.items())
            ],
            "rules": _rules_json(self.configs),
            "output_classes": None
            if self.output_classes is None
            else {cat: shares({}, counts) for cat, counts in sorted(self.output_classes.items())},
            "out_of_vocabulary": self.out_of_vocabulary,
            "cross_vocabulary": self.cross_vocabulary,
        }


def _rules_json(configs: tuple[Config, ...]) -> list[dict[str, Any]]:
    """Each dynamic rule scored: its law's constants, replay class and where it runs."""
    seen: dict[tuple[Rule, str], dict[str, Any]] = {}
    for c in configs:
        if c.rule is not None:
            seen.setdefault(
                (c.rule, c.proposer),
                {
                    "rule": c.rule.text,
                    "rule_name": c.rule.name,
                    "rule_params": c.rule.params_json(),
                    "proposer": c.proposer,
                    "replay_class": c.replay_class,
                    "how_to_run": how_to_run(c.rule),
                },
            )
    return list(seen.values())


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
    if method == "suffix":
        # The records carry no suffix_decoding_* settings: vLLM's defaults are assumed.
        return Config("suffix", k, suffix=SuffixKnobs())
    return None


def skip_reason(
    leg: Leg, config: Config | None, drafts: float | None, accepted: float | None
) -> str:
    """Why a candidate leg gets no live check: the replay checks an n-gram candidate whose
    configuration and per-request draft counts its engine reports."""
    if config is None:
        spec = leg.speculative
        if spec is None:
            return "its engine reports no speculative configuration (/server_info)"
        method = spec.method or "unknown"
        if method.lower().replace("-", "").replace("_", "") not in ("ngram", "promptlookup"):
            return f"it runs {method}: only n-gram and suffix candidates are replayed"
        return "its n-gram configuration lacks prompt_lookup_min/max or num_speculative_tokens"
    if drafts is None or accepted is None:
        return "its engine reports no per-request draft counts (acceptance.num_drafts)"
    return "its configuration was not scored on these records"


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
    rules: tuple[Rule, ...] = DEFAULT_RULES,
    drafter_rules: tuple[Rule, ...] = DRAFTER_RULES,
    per_request: Callable[[dict[str, Any]], None] | None = None,
    pieces: Mapping[int, str] | None = None,
    drafter_vocabulary: frozenset[int] | None = None,
    suffix: tuple[SuffixKnobs, ...] = (),
    llamacpp: tuple[LlamaKnobs, ...] = (),
    cross_vocab: tuple[CrossVocabScores, ...] = (),
) -> Matrix:
    """Score the grid on every record with tokens; ``open_records`` is called twice.

    ``rules``: the dynamic draft-length rules scored beside fixed k (:mod:`.rules`; a
    ``batch_schedule`` is a bound between the fixed-k rows of its smallest and largest k).
    ``pieces``: token id → text, to classify where drafts are rejected (:mod:`.rejections`).
    ``drafter_rules``: rules for draft models whose records carry the drafter's probabilities
    (the confidence exit: exact given the drafter).
    ``drafter_vocabulary``: the target ids a declared drafter can propose (EAGLE-3's ``d2t``).
    ``suffix``: the suffix-decoding knob sets scored at every depth (``SuffixKnobs()``: vLLM's
    defaults). A live suffix candidate is scored either way. Suffix decoding's global tree holds
    earlier responses, so records are replayed in the order ``open_records`` yields them
    (production's order; :mod:`.suffix`).
    ``llamacpp``: llama.cpp ``ngram-mod`` / ``ngram-map-k`` configurations (``n_max`` the depth),
    each one replayed server fed the records in order (:mod:`.llamacpp_replay`); a live llama.cpp
    n-gram candidate is replayed on what it served and checked against its own timings.
    ``cross_vocab``: drafters with their own tokenizer, already asked about the records
    (:mod:`.crossvocab_drafter`), scored at every depth by TLI and/or SLEM (:mod:`.crossvocab`).
    ``per_request`` receives, for every scored record, its replay under every configuration
    (:func:`request_json`) — streamed, never kept.
    """
    live: set[Config] = set()
    drafter_names: set[str] = set()
    confident: set[str] = set()  # drafters whose records carry their probabilities
    # llama.cpp n-gram candidates: what each runs, learned from any of its legs (the depth is
    # recorded only once the server drafted), so every request it served feeds its live check.
    llama_backends: dict[str, LlamaKnobs] = {}
    for record in map(read, open_records()):
        for leg in record.legs:
            if leg.role == "candidate":
                c = live_config(leg)
                if c is not None:
                    live.add(c)
                knobs = live_knobs(leg, llamacpp)
                if knobs is not None:
                    live.add(llamacpp_config(knobs))
                    llama_backends.setdefault(leg.backend, knobs)
        tok = _tokens(record)
        if tok is not None:
            drafter_names.update(tok[2])
            if record.tokens is not None:
                confident.update(record.tokens.drafter_confidence)
    replayed = tuple(r for r in rules if r.name != "batch_schedule")
    bounds = tuple(r for r in rules if r.name == "batch_schedule")
    bound_depths = {k for r in bounds for k in r.tiers() if k >= 1}
    configs = grid(
        depths=tuple(sorted({*depths, *bound_depths})),
        windows=windows,
        drafters=sorted(drafter_names),
        extra={
            *live,
            *(
                Config("draft_model", r.cap, drafter=d, rule=r)
                for d in sorted(confident & drafter_names)
                for r in drafter_rules
            ),
            *(
                Config("draft_model", k, drafter=xs.spec.name, cross_vocab=rule)
                for xs in cross_vocab
                for rule in xs.spec.rules
                for k in depths
            ),
        },
        rules=replayed,
        suffix=suffix,
        llamacpp=llamacpp,
    )
    max_k = max(c.num_speculative_tokens for c in configs)
    families: dict[tuple[Any, ...], list[Config]] = {}
    for c in configs:
        families.setdefault(c.family, []).append(c)
    bound_configs = tuple(
        Config(f[0], r.cap, f[1], f[2], f[3], rule=r)
        for f in families
        if f[0] in ("ngram", "draft_model") and f[6] is None
        for r in bounds
    )
    # One suffix cache per knob set, fed across records (the history is the point).
    suffix_caches: dict[SuffixKnobs, Any] = {}  # the library's cache, else the port's
    llama_checks: dict[tuple[str, LlamaKnobs], LlamaLiveCheck] = {}
    llama_servers: dict[LlamaKnobs, LlamaServer] = {}  # one replayed server per configuration

    xscores = {xs.spec.name: xs for xs in cross_vocab}
    # drafter → category → [output tokens, outside the intersection]; (drafter, category, k) →
    # [TLI rejections, of them by construction]
    xtally: dict[str, dict[str, list[int]]] = {xs.spec.name: {} for xs in cross_vocab}
    xrejected: dict[tuple[str, str, int], list[int]] = {}
    cells: dict[tuple[Config, str, str], Cell] = {}
    checks: dict[tuple[str, Config], LiveCheck] = {}
    skipped: dict[str, str] = {}  # candidate backend → why it has no live check (first reason)
    points: list[tuple[float, float, float]] = []
    primary_batches: list[float] = []
    output_classes: dict[str, dict[str, int]] | None = None if pieces is None else {}
    oov: dict[str, list[int]] = {}
    records = scored = 0
    for record in map(read, open_records()):
        records += 1
        for role, b, slots, step in _speed_points(record):
            points.append((b, slots, step))
            if role == "primary":
                primary_batches.append(b)
        feed_live(llama_checks, record, llama_backends)
        tok = _tokens(record)
        if tok is None:
            continue
        scored += 1
        prompt, output, drafted = tok
        category = record.category
        bucket = output_length_bucket(len(output)) or "unknown"
        greedy = record.greedy
        classes = None if pieces is None else classify_output([pieces.get(t, "") for t in output])
        for cat in (category, ALL):
            if output_classes is not None and classes is not None:
                counts = output_classes.setdefault(cat, {})
                for cls in classes:
                    counts[cls] = counts.get(cls, 0) + 1
            if drafter_vocabulary is not None:
                tally = oov.setdefault(cat, [0, 0])
                tally[0] += len(output)
                tally[1] += sum(t not in drafter_vocabulary for t in output)
        results: dict[Config, Replay] = {}
        for family, members in families.items():
            proposer, lo, hi, drafter, knobs, llama, xv = family
            predicted: list[int] | None = None
            if xv is not None:
                _cross_vocab(xscores[drafter or ""], xv, members, record.exchange_id, output,
                             results, (category, ALL), xtally, xrejected)  # fmt: skip
                continue
            if llama is not None:
                server = llama_servers.get(llama) or llama_servers.setdefault(llama, llama.server())
                results[members[0]] = server.serve(prompt, output)
                continue
            if knobs is not None:
                cache = suffix_caches.get(knobs)
                if cache is None:
                    cache = suffix_caches[knobs] = knobs.cache()
                offered = suffix_offers(
                    cache,
                    scored,
                    prompt,
                    output,
                    [knobs.spec(c.num_speculative_tokens) for c in members],
                )
                for c, (available, match) in zip(members, offered, strict=True):
                    results[c] = replay(len(output), c.num_speculative_tokens, available, match)
                continue
            if proposer == "ngram" and lo is not None and hi is not None:
                available, match = ngram_offers(prompt, output, lo, hi, max_k)
            else:
                predicted = drafted.get(drafter or "")  # the reader's {drafter: ids}
                if predicted is None or len(predicted) != len(output):
                    continue
                available, match = drafter_offers(output, predicted)
            for c in members:
                offers = (available, match)
                if c.rule is not None and c.rule.name == "confidence":
                    probs = (record.tokens.drafter_confidence if record.tokens else {}).get(
                        drafter or ""
                    )
                    if predicted is None or probs is None or len(probs) != len(output):
                        continue
                    offers = confidence_offers(
                        output, predicted, probs, c.rule.get("threshold"), c.rule.cap
                    )
                results[c] = replay(len(output), c.num_speculative_tokens, *offers, rule=c.rule)
        if per_request is not None:
            per_request(request_json(record, category, bucket, greedy, results))
        for c, r in results.items():
            for cat in (category, ALL):
                for bk in (bucket, ALL):
                    cell = cells.setdefault((c, cat, bk), Cell(c.num_speculative_tokens))
                    cell.add(r, greedy, classes)
        own_ids = record.tokens.legs if record.tokens is not None else {}
        for leg in record.legs:
            if leg.role != "candidate":
                continue
            c = live_config(leg)
            drafts = leg.acceptance.num_drafts
            accepted = leg.acceptance.num_accepted_tokens
            if c is None or c not in results or drafts is None or accepted is None:
                skipped.setdefault(leg.backend, skip_reason(leg, c, drafts, accepted))
                continue
            check = checks.setdefault((leg.backend, c), LiveCheck(leg.backend, c))
            spec = leg.speculative
            if spec is not None and spec.adaptive_verification:
                check.upper_bound = True
            own = own_ids.get(check.backend) or None  # the reader's {backend: generated ids}
            check.add(
                greedy,
                results[c],
                drafts,
                accepted,
                agrees=agrees(record, leg, own, output, own_ids),
                baseline_agrees=baseline_agrees(record, output, own_ids),
            )
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
    rows: list[dict[str, Any]] = []
    for (c, cat, bk), cell in sorted(cells.items(), key=_order):
        shown = None if output_classes is None or bk != ALL else output_classes.get(cat)
        rows.append(make_row(c, cat, bk, cell, model, shown))
        if c.rule is None and c.num_speculative_tokens == max(depths) and bk == ALL:
            rows.extend(bound_row(b, cat, bk, cells) for b in bound_configs if b.family == c.family)
    picks = _picks(rows, configs)
    xjson = [
        {
            **xs.as_json(),
            "categories": {
                cat: {
                    "output_tokens": n,
                    "outside_intersection": miss,
                    "outside_share": miss / n if n else None,
                    "tli_rejections": {
                        str(k): {"rejections": v[0], "by_construction": v[1]}
                        for (d, c, k), v in sorted(xrejected.items())
                        if d == xs.spec.name and c == cat
                    },
                }
                for cat, (n, miss) in sorted(xtally[xs.spec.name].items())
            },
        }
        for xs in cross_vocab
    ]
    deploy = _deploy(picks, configs)
    return Matrix(
        rows=rows,
        picks=picks,
        deploy=deploy,
        live=[live_json(ch) for ch in checks.values()],
        live_skipped={
            b: why
            for b, why in skipped.items()
            if b not in {k[0] for k in checks} | {k[0] for k in llama_checks}
        },
        live_llamacpp=[
            ch.as_json(config_json(llamacpp_config(ch.knobs))) for ch in llama_checks.values()
        ],
        model=model,
        records=records,
        scored=scored,
        configs=configs + bound_configs,
        cross_vocabulary=xjson,
        output_classes=output_classes,
        out_of_vocabulary=None
        if drafter_vocabulary is None
        else {
            "vocabulary_size": len(drafter_vocabulary),
            "categories": {
                cat: {
                    "output_tokens": n,
                    "out_of_vocabulary": miss,
                    "share": miss / n if n else 0.0,
                    # A drafter that cannot name the token is rejected wherever it is drafted.
                    "guaranteed_rejections": miss,
                }
                for cat, (n, miss) in sorted(oov.items())
            },
        },
    )


def _cross_vocab(
    xs: CrossVocabScores,
    rule: str,
    members: list[Config],
    exchange_id: str,
    output: list[int],
    results: dict[Config, Replay],
    cats: tuple[str, str],
    tally: dict[str, dict[str, list[int]]],
    rejected: dict[tuple[str, str, int], list[int]],
) -> None:
    """One record under a cross-vocabulary drafter's configurations (``rule``: tli or slem)."""
    name = xs.spec.name
    if rule == "tli":
        argmax = xs.tli.get(exchange_id)
        if argmax is None or len(argmax) != len(output):
            return
        outside = 0
        for c in members:
            r, outside, by_construction = tli_replay(
                xs.intersection, output, argmax, c.num_speculative_tokens
            )
            results[c] = r
            for cat in cats:
                v = rejected.setdefault((name, cat, c.num_speculative_tokens), [0, 0])
                v[0] += len(r.rejected_at)
                v[1] += by_construction
        for cat in cats:
            t = tally[name].setdefault(cat, [0, 0])
            t[0] += len(output)
            t[1] += outside
        return
    texts = xs.output_texts(output)
    for c in members:
        drafts = xs.slem.get((exchange_id, c.num_speculative_tokens))
        if drafts is None or len(drafts) != len(output):
            continue
        available, match = slem_offers(texts, drafts)
        # A step verifies every target token the draft's text re-encodes to: no cap but that.
        results[c] = replay(len(output), max([1, *available]), available, match)


def _order(item: tuple[tuple[Config, str, str], Cell]) -> tuple[Any, ...]:
    (c, cat, bk), _ = item
    return (cat != ALL, cat, bk != ALL, bk, *sort_key(c))


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
        # SLEM is transformers' assisted generation, not a configuration vLLM serves.
        if row["output_length_bucket"] == ALL and row.get("cross_vocab_rule") != "slem":
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
    return (
        row["proposer"],
        row["prompt_lookup_min"],
        row["prompt_lookup_max"],
        row["drafter"],
        row.get("cross_vocab_rule"),
    )


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
