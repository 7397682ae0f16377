"""The report's Markdown summary: the verdicts, the recommendation, the candidates and the few
numbers a reviewer needs in a pull request or a ticket (pure; tables from
:mod:`report.render`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from report import workflows_view as wv
from report.analysis import ALL, Analysis
from report.candidates import RULE
from report.front import first_use, front
from report.load import OPEN_LOOP
from report.render import (
    CAND_HEAD,
    EQUIVALENCE_HEAD,
    candidate_rows,
    counterfactual_rows,
    equivalence_rows,
    est,
    failure_rows,
    gate_text,
    head_to_head_rows,
    quality_rows,
    recommendation_rows,
    rollout_rows,
    sp,
    verdict_matrix,
)

__all__ = ["render_markdown"]


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    return [
        "| " + " | ".join(cell(h) for h in head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows),
        "",
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def _contents(lines: Sequence[str]) -> list[str]:
    """A table of contents of the ``## `` headings in ``lines`` (code blocks aside)."""
    out, code = [], False
    for line in lines:
        if line.startswith("```"):
            code = not code
        elif not code and line.startswith("## "):
            name = line[3:].strip()
            out.append(f"- [{name}](#{slug(name)})")
    return out


def _glossed(text: str) -> str:
    """``text`` with each term's gloss after the block (paragraph, table, list) where it first
    appears; headings and code never glossed."""
    blocks = text.split("\n\n")
    return "\n\n".join(
        first_use(
            blocks,
            lambda b: b,
            lambda term, meaning: f"> *{term}*: {meaning}",
            skip=lambda b: b.lstrip().startswith(("#", "```", ">")),
        )
    )


def render_markdown(a: Analysis, *, title: str, html_name: str) -> str:
    top = [
        f"# {title}",
        "",
        f"Full report with figures: `{html_name}`. {a.records} comparison records"
        + (f" (detail sections: a sample of {a.sample})." if a.sample else "."),
        "",
    ]
    glance = front(a)
    if glance:
        top += ["## At a glance", ""]
        top += [f"- **{line.title}** — {line.text}" for line in glance]
        top.append("")
    lines: list[str] = []
    if a.workflows is not None and a.workflows.types:  # the run leads where calls form runs
        lines += [f"## {wv.TITLE}", "", wv.intro(a.workflows), ""]
        lines += _table(wv.HEAD, wv.rows(a.workflows))
    if a.candidates:
        lines += ["## Bottom line", ""]
        if a.several:
            head, rows = verdict_matrix(a)
            lines += _table(head, rows)
        else:
            main = a.main
            assert main is not None
            rows = []
            for v in main.verdicts:
                why = "; ".join(v.reasons)
                if v.decision == "not_enough_data" and v.pairs_needed:
                    why += f"; need ≈{v.pairs_needed} pairs"
                at = v.at_load.e2e if v.at_load is not None else None
                rows.append([v.category, f"**{v.label}**", est(at), sp(v.e2e), sp(v.tpot), why])
            lines += _table(
                [
                    "category",
                    "verdict",
                    "e2e speedup at production load [95 % CI]",
                    "raw e2e speedup",
                    "raw tpot speedup",
                    "why",
                ],
                rows,
            )
        lines += ["### Recommendation", "", RULE, ""]
        lines += _table(["category", "ship", "why"], recommendation_rows(a))
        if a.policy_fragment:
            lines += [
                "Policy rules that keep each category on its pick:",
                "",
                "```yaml",
                a.policy_fragment.rstrip(),
                "```",
                "",
            ]
        lines += ["## Candidates", ""]
        lines += _table(CAND_HEAD, candidate_rows(a))
        for c in a.candidates.values():
            if c.failing:
                of = f" — {c.label}" if a.several else ""
                lines += [f"## Failures{of}", ""]
                lines += _table(["legs", "count"], failure_rows(c))
            if c.confound is not None and c.confound.confounded and c.confound.fragment:
                lines += [
                    f"## Confounded — {c.label}",
                    "",
                    f"{c.confound.reason()}.",
                    "",
                    "```yaml",
                    c.confound.fragment.rstrip(),
                    "```",
                    "",
                ]
    if a.several:
        lines += ["## Head to head (same requests, at production's load)", ""]
        lines += _table(
            ["category", "pair", "e2e ratio", "tpot ratio", "pairs at load / mirrored", "result"],
            head_to_head_rows(a),
        )
    _, gate = gate_text(a)
    lines += ["## Decision gate", "", gate, ""]
    lines += _load(a)
    for c in a.candidates.values():
        if c.failing:  # its failures are above; it has no outputs worth judging
            continue
        eq_rows = equivalence_rows(c, a.categories)
        if eq_rows:
            of = f" — {c.label}" if a.several else ""
            lines += [f"## Quality equivalence{of}", ""]
            lines += _table(EQUIVALENCE_HEAD, eq_rows)
        rows = [row[:4] for row in quality_rows(c, a.categories)]
        if rows:
            of = f" — {c.label}" if a.several else ""
            lines += [f"## Quality vs noise floor{of}", ""]
            lines += _table(
                ["category", "candidate diverges", "baseline diverges", "verdict"], rows
            )
    picks, live = counterfactual_rows(a)
    if picks:
        lines += ["## Counterfactual: every proposer and depth on production's outputs", ""]
        lines += ["Predicted, never measured (`counterfactual.json`, `candidates.yaml`).", ""]
        lines += _table(
            ["category", "pick", "mean acceptance length", "predicted TPOT speed-up", ""], picks
        )
        if live:
            lines += _table(
                [
                    "backend",
                    "configuration",
                    "predicted",
                    "measured",
                    "replayed on its own output",
                    "",
                ],
                live,
            )
        if a.counterfactual is not None:
            from counterfactual.render import (
                positions_table,
                rejections_table,
                rules_table,
                vocabulary_table,
            )

            for title, (head, rows) in (
                ("Dynamic lookahead against the best fixed k", rules_table(a.counterfactual)),
                ("Where drafts are rejected", rejections_table(a.counterfactual)),
                ("Acceptance by position in the output", positions_table(a.counterfactual)),
                ("Outside the drafter's vocabulary", vocabulary_table(a.counterfactual)),
            ):
                if rows:
                    lines += [f"### {title}", "", *_table(head, rows)]
    if a.rollout:
        lines += ["## Rollout", ""]
        lines += _table(
            ["rule", "stage", "from", "to", "exchanges", "answered by the candidate", "failovers"],
            rollout_rows(a),
        )
        if a.rollbacks:
            lines += [f"- Rule {rb.rule}: {rb.text()}." for rb in a.rollbacks]
            lines.append("")
    if a.matrix:
        lines += ["## Stable operating region", ""]
        lines += [f"- {line}" for line in a.stable_regions] or ["- none found"]
        lines.append("")
    if a.checklist:
        lines += ["## Release checklist", ""]
        lines += [f"{i}. {item}" for i, item in enumerate(a.checklist, start=1)]
        lines.append("")
    contents = ["## Contents", "", *_contents(lines), ""] if lines else []
    return _glossed("\n".join([*top, *contents, *lines]))


def _load(a: Analysis) -> list[str]:
    if not a.candidates or all(c.failing for c in a.candidates.values()):
        return []  # a candidate that does not answer has no load to speak of
    lines = ["## Load", "", OPEN_LOOP, ""]
    for c in a.candidates.values():
        who = f"{c.label}: " if a.several else ""
        if c.crossover is not None:
            lines += [
                f"{who}speculation stops paying at about {c.crossover.load:.3g} requests/s per "
                f"replica; depth schedule `{c.schedule}`.",
                "",
            ]
    lines += [f"- {n}" for n in a.notes if n != OPEN_LOOP]
    main = a.main
    assert main is not None
    excluded: Mapping[str, int] = main.exclusions.get(ALL, {})
    if excluded:
        lines += ["", "| exchanges | count |", "|---|---|"]
        lines += [f"| {r} | {n} |" for r, n in sorted(excluded.items(), key=lambda kv: -kv[1])]
    lines.append("")
    return lines
