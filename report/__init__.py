"""The adoption report: comparison records (and loadgen/matrix results) → one self-contained HTML
page with embedded figures plus a Markdown summary, answering "adopt speculative decoding, for
which traffic, and how do we roll back?".

With token ids in the records (the policy's ``counterfactual`` section), the report also scores
every proposer and depth on them (:mod:`counterfactual`) and writes ``counterfactual.json``,
``counterfactual.md`` and ``candidates.yaml`` beside the report.

Layout: ``inputs`` (result files; records come from :mod:`records.readback`), ``records``
(record accessors), ``aggregates`` (the window's aggregates: the types both engines build),
``population`` (those aggregates and the bounded sample, streamed in Python) and ``sql`` (the same
computed in ClickHouse/chDB), ``gather`` (which of the two sums a window), ``sections`` (latency,
raw speed-ups, acceptance, quality, gate), ``model`` (their typed result tables: raw speed-ups,
acceptance, KV-cache usage; the matrix's and the load generator's rows are typed in
:mod:`loadgen`), ``load`` (speed-ups at production's load, crossover, schedule, capacity), ``analysis`` (per candidate,
verdicts), ``failures`` (a candidate's legs by how they failed: ``candidate_failing``),
``rollbacks`` (rollouts rolled back inside the window: ``rolled_back``), ``workflows`` (calls
grouped into application runs and workflow types, each candidate's projected run speed-up;
``workflows_view`` words it, ``spans`` reads the application's own spans from a column store), ``confounds`` (a
candidate that differs from production in more than speculation: ``confounded``), ``requalify``
(the window split at an engine configuration change), ``episodes`` (the window split at a
rolled-back rollout episode: its legs make no load figure, verdict or pick), ``candidates`` (who each
candidate is, lossless or not, head to head, the recommendation), ``checklist``, ``front`` (the
first screen, the glosses), ``export`` (``report.json``), ``plots`` (matplotlib Agg → PNG data URIs),
``render`` (HTML) and ``markdown`` (the summary), pure, ``cli`` (``specshadow report``). :func:`build_report` is the one entry point for code (the demo).

numpy and matplotlib are imported when a report is built, not when this package is imported, so
registering the ``report`` command costs every other command nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from report.aggregates import Population
    from report.analysis import Analysis

__all__ = ["TITLE", "ReportPaths", "build_report"]

TITLE = "Speculative decoding: adoption report"


@dataclass(frozen=True, slots=True)
class ReportPaths:
    html: Path
    markdown: Path
    json: Path
    analysis: Analysis
    rollout: dict[str, Path] = field(default_factory=dict)  # rollout.yaml, Argo, Flagger


def build_report(
    records: Iterable[Mapping[str, Any]],
    results: Iterable[Mapping[str, Any]] | None,
    out_dir: str | Path,
    *,
    title: str = TITLE,
    sources: Sequence[str] = (),
    margins: Mapping[str, float] | None = None,
    alpha: float | None = None,
    population: Population | None = None,
    rollout_state: str | Path | None = None,
    transitions: Sequence[Mapping[str, Any]] = (),
    token_texts: Mapping[int, str] | None = None,
    spans: Mapping[str, tuple[int, int]] | None = None,
) -> ReportPaths:
    """Write ``report.html``, ``report.md`` and ``report.json`` into ``out_dir`` (created if
    missing) — and, when a configuration is recommended, ``rollout.yaml``, an Argo Rollouts
    ``AnalysisTemplate`` and Flagger metric templates with the guards (:mod:`.rollout`).

    ``population``: the window's aggregates when ``records`` is its bounded sample
    (:func:`report.gather.gather`, what ``specshadow report`` does). ``rollout_state``: the
    gateway's rollout state file (``--state``) and/or ``transitions`` (``GET /admin/rollout``'s
    ``last_transition``s): who rolled a rule back inside the window, and on which reading.
    ``token_texts``: token id → text (:func:`counterfactual.cli.token_texts`), to classify where
    the counterfactual matrix's drafts were rejected; the report itself calls no server.
    ``spans``: the application's own spans' first start and last end per trace id
    (:func:`report.spans.store_bounds`), for the workflow runs' true start and end."""
    from core import jsonx
    from counterfactual.cli import write_outputs
    from counterfactual.matrix import build_matrix
    from records.reader import read
    from report.analysis import analyze
    from report.export import report_json
    from report.markdown import render_markdown
    from report.plots import figures
    from report.render import render_html
    from report.rollbacks import load_transitions
    from report.rollout import (
        argo_analysis_template,
        flagger_metric_templates,
        rollout_yaml,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = records if isinstance(records, list) else list(records)
    from core.quality import DEFAULT_ALPHA, DEFAULT_MARGINS

    # The policy asked for token ids: score every proposer and depth on them (and, with the
    # token texts, classify where drafts were rejected).
    counterfactual = (
        build_matrix(lambda: iter(records), pieces=token_texts)
        if any(read(r).tokens is not None for r in records)
        else None
    )
    a = analyze(
        records,
        results,
        margins={**DEFAULT_MARGINS, **(margins or {})},
        alpha=alpha if alpha is not None else DEFAULT_ALPHA,
        population=population,
        transitions=[
            *transitions,
            *(load_transitions(rollout_state) if rollout_state is not None else ()),
        ],
        counterfactual=counterfactual,
        spans=spans,
    )
    if counterfactual is not None:
        write_outputs(counterfactual, out)
    html_path, md_path, json_path = out / "report.html", out / "report.md", out / "report.json"
    html_path.write_text(render_html(a, figures(a), title=title, sources=sources), "utf-8")
    md_path.write_text(render_markdown(a, title=title, html_name=html_path.name), "utf-8")
    json_path.write_bytes(jsonx.dumps(report_json(a), indent=True) + b"\n")
    rollout: dict[str, Path] = {}
    for name, text in (
        ("rollout.yaml", rollout_yaml(a)),
        ("argo-analysis-template.yaml", argo_analysis_template(a)),
        ("flagger-metric-templates.yaml", flagger_metric_templates(a)),
    ):
        path = out / name
        if text is None:  # nothing recommended: no stale guards left from an earlier run
            path.unlink(missing_ok=True)
            continue
        path.write_text(text, "utf-8")
        rollout[name] = path
    return ReportPaths(
        html=html_path, markdown=md_path, json=json_path, analysis=a, rollout=rollout
    )
