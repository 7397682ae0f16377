"""The counterfactual matrix for people: a Markdown summary and the policy fragment of the picks.

Every speed-up here is *predicted* (acceptance replayed on production's outputs, step time from
the fitted model) and says so; acceptance measured on a live candidate appears only in the
predicted-vs-measured table. Everything here reads the matrix's own rows, picks and live checks
(:class:`~counterfactual.matrix.Matrix`), never a record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from counterfactual.grid import Config
from counterfactual.llamacpp_replay import server_args
from counterfactual.matrix import ALL, Matrix
from counterfactual.rules import how_to_run

__all__ = [
    "policy_fragment",
    "positions_table",
    "rejections_table",
    "render_markdown",
    "rules_table",
    "vocabulary_table",
]


def _f(value: object, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "–"


def _interval(obj: Mapping[str, Any] | None, digits: int = 2) -> str:
    if obj and obj.get("estimate") is None and obj.get("low") is not None:
        return f"bound [{_f(obj['low'], digits)}, {_f(obj['high'], digits)}]"
    if not obj or obj.get("estimate") is None:
        return "–"
    if obj.get("low") is None:
        return _f(obj["estimate"], digits)
    return f"{_f(obj['estimate'], digits)} [{_f(obj['low'], digits)}, {_f(obj['high'], digits)}]"


def _speedup(row: Mapping[str, Any]) -> str:
    estimate = row.get("predicted_tpot_speedup")
    if estimate is None:
        return "–"
    interval = row.get("predicted_tpot_speedup_interval") or {}
    return f"{_interval({'estimate': estimate, **interval})}×"


def render_markdown(m: Matrix, *, top: int = 8) -> str:
    lines = [
        "# Counterfactual speculation: every proposer and depth on production's outputs",
        "",
        f"{m.scored} of {m.records} records carried token ids and were replayed under "
        f"{len(m.configs)} configurations. Acceptance is replayed exactly (greedy requests) or "
        "as an exact draw (sampled ones); speed-ups are **predicted** from a step-time model, "
        "never measured.",
        "",
    ]
    if m.model is not None:
        mo = m.model
        lines += [
            f"Step-time model: step = {mo.base_s * 1e3:.3f} ms + {mo.slot_s * 1e3:.4f} ms × batch × "
            f"(1 + drafted per pass), production's batch {mo.batch:.1f}, {mo.points} legs. "
            f"{mo.note}.",
            "",
        ]
    else:
        lines += ["No leg carried TPOT and batch: no speed-up is predicted, configurations are "
                  "ranked by tokens per pass.", ""]  # fmt: skip
    lines += ["## Picks per category", "", "| category | pick | mean acceptance length | "
              "predicted TPOT speed-up | runner-up (another proposer) |", "|---|---|---|---|---|"]  # fmt: skip
    for cat, pick in sorted(m.picks.items(), key=lambda kv: (kv[0] != ALL, kv[0])):
        if pick["config"] is None:
            lines.append(f"| {cat} | none: {pick['reason']} | – | – | – |")
            continue
        s = pick["predicted_tpot_speedup"]
        lines.append(
            f"| {cat} | {pick['config']['label']} | {_interval(pick['mean_acceptance_length'])} | "
            f"{_interval(s) + '×' if s and s.get('estimate') is not None else '–'} | "
            f"{pick['runner_up'] or '–'} |"
        )
    if m.deploy:
        lines += ["", "Worth deploying as live candidates: "
                  + ", ".join(f"**{c.label}**" for c in m.deploy)
                  + " (`candidates.yaml` has the policy fragment)."]  # fmt: skip
    if m.live:
        lines += ["", "## Predicted against measured (live candidates, same requests)", "",
                  "| backend | configuration | predicted | measured | gap | |", "|---|---|---|---|---|---|"]  # fmt: skip
        for live in m.live:
            lines.append(
                f"| {live['backend']} | {live['label']} | "
                f"{_interval(live['predicted_mean_acceptance_length'])} | "
                f"{_interval(live['measured_mean_acceptance_length'])} | "
                f"{_f((live['relative_gap'] or 0) * 100, 1)} % | "
                f"{'⚠ ' + live['note'] if live['flag'] else 'ok'} |"
            )
    if m.live_llamacpp:
        lines += ["", "## Predicted against measured (llama.cpp n-gram candidates, drafted / "
                  "accepted tokens per request)", "",
                  "| backend | configuration | requests equal | predicted | measured |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for live in m.live_llamacpp:
            p, q = live["predicted"], live["measured"]
            lines.append(
                f"| {live['backend']} | {live['label']} | {live['requests_equal']} of "
                f"{live['requests']} | {p['accepted']} / {p['draft_tokens']} | "
                f"{q['accepted']} / {q['draft_tokens']} |"
            )
    for backend, why in sorted(m.live_skipped.items()):
        lines += ["", f"No live check against the prediction for {backend}: {why}."]
    overall = [r for r in m.rows if r["category"] == ALL and r["output_length_bucket"] == ALL]
    overall.sort(key=lambda r: -(r["predicted_tpot_speedup"] or 0.0))
    lines += ["", f"## The best {min(top, len(overall))} configurations, all traffic", "",
              "| configuration | requests | mean acceptance length | acceptance by position | "
              "tokens per pass | predicted TPOT speed-up |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in overall[:top]:
        positions = " ".join(_f(v) for v in r["acceptance_by_position"])
        lines.append(
            f"| {r['label']} | {r['requests']} | {_interval(r['mean_acceptance_length'])} | "
            f"{positions} | {_interval(r['tokens_per_pass'])} | {_speedup(r)} |"
        )
    lines += _rules_section(m) + _rejections_section(m)
    lines += ["", "Every row, per category and output length: `counterfactual.json`. Method and "
              "limits: docs/counterfactual.md.", ""]  # fmt: skip
    return "\n".join(lines)


Table = tuple[
    list[str], list[list[str]]
]  # (head, rows): the report renders them as it renders tables


def rules_table(m: Matrix) -> Table:
    """Per proposer family, all traffic: its best fixed k, then every dynamic rule."""
    overall = [r for r in m.rows if r["category"] == ALL and r["output_length_bucket"] == ALL]
    head = ["configuration", "replay", "mean acceptance length", "tokens per pass",
            "predicted TPOT speed-up"]  # fmt: skip
    if not any(r["rule"] is not None for r in overall):
        return head, []
    families: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in overall:
        key = (r["proposer"], r["prompt_lookup_min"], r["prompt_lookup_max"], r["drafter"],
               r.get("cross_vocab_rule"))  # fmt: skip
        families.setdefault(key, []).append(r)
    shown: list[dict[str, Any]] = []
    for rows in families.values():
        fixed = [r for r in rows if r["rule"] is None]
        best = max(fixed, key=lambda r: r["predicted_tpot_speedup"] or (r["tokens_per_pass"]["estimate"] or 0.0), default=None)  # fmt: skip
        shown += ([best] if best is not None else []) + [r for r in rows if r["rule"] is not None]
    return head, [
        [r["label"], r["replay_class"], _interval(r["mean_acceptance_length"]),
         _interval(r["tokens_per_pass"]), _speedup(r)]
        for r in shown
    ]  # fmt: skip


def _chosen(m: Matrix) -> list[dict[str, Any]]:
    """Per category, its pick's all-lengths row (else its best-ranked row)."""
    rows = {(r["category"], r["label"]): r for r in m.rows if r["output_length_bucket"] == ALL}
    out = []
    for cat, pick in sorted(m.picks.items(), key=lambda kv: (kv[0] != ALL, kv[0])):
        label = pick["config"]["label"] if pick["config"] else (pick["ranking"] or [None])[0]
        row = rows.get((cat, label)) if label else None
        if row is not None:
            out.append(row)
    return out


def rejections_table(m: Matrix, top: int = 4) -> Table:
    """Per category, for its pick: the classes of the first rejected tokens (the ``top`` most
    frequent), each one's share of rejections against its share of output tokens."""
    head = ["category", "configuration", "rejected token", "share of rejections",
            "share of output tokens"]  # fmt: skip
    rows = []
    for r in _chosen(m):
        classes = sorted((r.get("rejections") or {}).items(),
                         key=lambda kv: -kv[1]["rejection_share"])  # fmt: skip
        rows += [
            [r["category"], r["label"], cls, f"{_f(v['rejection_share'] * 100, 1)} %",
             f"{_f(v['output_share'] * 100, 1)} %"]
            for cls, v in classes[:top]
        ]  # fmt: skip
    return head, rows


def positions_table(m: Matrix) -> Table:
    """Per category, for its pick: draft acceptance in the output's first tokens and after."""
    head = ["category", "configuration", "first tokens: draft acceptance", "the rest"]
    rows = []
    for r in _chosen(m):
        pos = r.get("acceptance_by_output_position") or {}
        first, rest = pos.get("first") or {}, pos.get("rest") or {}
        rows.append([
            r["category"], r["label"],
            f"{_f(first.get('draft_acceptance_rate'))} (first {pos.get('first_tokens', '–')}; "
            f"{first.get('drafts', 0)} steps)",
            f"{_f(rest.get('draft_acceptance_rate'))} ({rest.get('drafts', 0)} steps)",
        ])  # fmt: skip
    return head, rows


def vocabulary_table(m: Matrix) -> Table:
    """Per category: output tokens outside a declared drafter vocabulary (rejections by
    construction)."""
    head = ["category", "output tokens", "outside the drafter's vocabulary", "share"]
    oov = m.out_of_vocabulary
    if oov is None:
        return head, []
    return head, [
        [cat, str(v["output_tokens"]), str(v["out_of_vocabulary"]), f"{_f(v['share'] * 100, 1)} %"]
        for cat, v in oov["categories"].items()
    ]


def crossvocab_table(m: Matrix) -> Table:
    """Per cross-vocabulary drafter and category: output tokens outside the intersection, and at
    each depth the TLI rejections that were rejections by construction."""
    head = ["drafter", "category", "output tokens", "outside the intersection", "share",
            "TLI rejections by construction (k: of all)"]  # fmt: skip
    rows = []
    for xs in m.cross_vocabulary:
        for cat, v in xs["categories"].items():
            by_k = ", ".join(
                f"{k}: {r['by_construction']}/{r['rejections']}"
                for k, r in v["tli_rejections"].items()
            )
            share = v["outside_share"]
            rows.append([xs["drafter"], cat, str(v["output_tokens"]),
                         str(v["outside_intersection"]),
                         "" if share is None else f"{_f(share * 100, 1)} %", by_k])  # fmt: skip
    return head, rows


def _crossvocab_section(m: Matrix) -> list[str]:
    head, rows = crossvocab_table(m)
    if not m.cross_vocabulary:
        return []
    lines = [
        "",
        "## Cross-vocabulary drafters",
        "",
        *(
            f"- `{xs['drafter']}` ({xs['url']}): intersection {xs['intersection_size']} tokens; "
            f"{xs['no_candidate_in_top']} of {xs['tli_positions']} positions had no top-"
            f"{xs['top_logprobs']} candidate inside it (scored as rejected); SLEM on "
            f"{xs['slem_records']} records; {xs['calls']} calls, {xs['failed_calls']} failed."
            for xs in m.cross_vocabulary
        ),
    ]
    return [*lines, "", *_md(head, rows)] if rows else lines


def _md(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows)]  # fmt: skip


def _rules_section(m: Matrix) -> list[str]:
    head, rows = rules_table(m)
    if not rows:
        return []
    lines = ["", "## Dynamic lookahead against the best fixed k, all traffic", "", *_md(head, rows)]
    lines += ["", "A bound is the range between its schedule's fixed-k rows, not a confidence "
              "interval. Where each rule runs:", ""]  # fmt: skip
    lines += [f"- `{r['rule']}`: {r['how_to_run']}" for r in m.as_json()["rules"]]
    return lines


def _rejections_section(m: Matrix) -> list[str]:
    lines: list[str] = []
    head, rows = rejections_table(m)
    if rows:
        lines += ["", "## Where drafts are rejected (each category's pick)", "",
                  "What the target's token was at each step's first rejected position, against that "
                  "class's share of the output.", "", *_md(head, rows)]  # fmt: skip
    head, rows = positions_table(m)
    if rows:
        lines += ["", "## Acceptance by position in the output", "", *_md(head, rows)]
    head, rows = vocabulary_table(m)
    if rows:
        assert m.out_of_vocabulary is not None
        lines += ["", f"## Outside the declared drafter vocabulary "
                  f"({m.out_of_vocabulary['vocabulary_size']} tokens)", "", *_md(head, rows)]  # fmt: skip
    return lines + _crossvocab_section(m)


def _backend_name(c: Config) -> str:
    if c.llamacpp is not None:
        return f"{c.proposer}-k{c.num_speculative_tokens}-n{c.llamacpp.n_match}"
    if c.proposer == "ngram":
        return f"ngram-k{c.num_speculative_tokens}-{c.prompt_lookup_min}-{c.prompt_lookup_max}"
    if c.suffix is not None:
        return f"suffix-k{c.num_speculative_tokens}-d{c.suffix.max_tree_depth}"
    if c.cross_vocab is not None:
        return f"draft-{c.drafter}-k{c.num_speculative_tokens}-{c.cross_vocab}"
    return f"draft-{c.drafter}-k{c.num_speculative_tokens}"


def policy_fragment(m: Matrix) -> str | None:
    """YAML to paste into a policy: the picks as candidate backends and legs (None: no pick).
    A pick that is a dynamic rule is a comment saying which engine runs it and how."""
    if not m.deploy:
        return None
    out = [
        "# specshadow counterfactual: the configurations worth deploying as live candidates.",
        "# Serve each on its own vLLM with the --speculative-config shown, set its url, and add",
        "# the legs to the rule that mirrors the traffic they were scored on. Predicted, not",
        "# measured: the live candidate's records will say whether the prediction holds.",
    ]
    out += [
        f"# Pick: {c.label} ({c.replay_class}). {how_to_run(c.rule)}."
        for c in m.deploy
        if c.rule is not None
    ]
    engines = [c for c in m.deploy if c.rule is None]
    if not engines:
        return "\n".join(out) + "\n"
    out.append("backends:")
    for c in engines:
        spec = c.speculative_config()
        out.append(f"  {_backend_name(c)}:")
        out.append("    url: http://REPLACE-ME:8000")
        if c.llamacpp is not None:
            out.append("    kind: llamacpp")
            args = " ".join(server_args(c.llamacpp))
            out.append(f"    # llama-server -m TARGET.gguf {args}")
        else:
            out.append("    kind: vllm")
            out.append(f"    # vllm serve TARGET --speculative-config '{_json(spec)}'")
        out.append("    speculative:")
        method = c.proposer
        out.append(f"      method: {method}")
        out.append(f"      num_speculative_tokens: {c.num_speculative_tokens}")
        if c.proposer == "ngram":
            out.append(f"      prompt_lookup_min: {c.prompt_lookup_min}")
            out.append(f"      prompt_lookup_max: {c.prompt_lookup_max}")
        if c.cross_vocab is not None:
            out.append("      cross_vocabulary: true")
        out.append(f'      label: "{c.label}"')
    out.append("legs:  # add to your rule's legs")
    out.extend(f"  - {{backend: {_backend_name(c)}, role: candidate}}" for c in engines)
    return "\n".join(out) + "\n"


def _json(obj: Mapping[str, Any]) -> str:
    from core import jsonx

    return jsonx.dumps(obj).decode()
