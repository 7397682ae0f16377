"""Every figure of the report is readable: no legend over data, no label cut off at the figure's
edge, and no figure of nothing (an all-zero chart is replaced by a sentence). Checked on the
drawn matplotlib figures themselves, in display coordinates — the PNG the page embeds is exactly
this canvas."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from matplotlib.figure import Figure

import report.plots as plots
from report.analysis import analyze
from tests.report.synthetic import records
from tests.report.test_report import (
    LOADGEN_ROWS,
    MATRIX_ROWS,
    sample_records,
    several_with_rollout,
)


def _outside(bb: Any, width: float, height: float) -> bool:
    return bool(bb.x0 < -1 or bb.y0 < -1 or bb.x1 > width + 1 or bb.y1 > height + 1)


def problems(fig: Figure) -> list[str]:
    """What is wrong with ``fig``'s layout (empty: nothing)."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    width, height = fig.bbox.width, fig.bbox.height
    out: list[str] = []
    for ax in fig.axes:
        x0, x1 = sorted(ax.get_xlim())
        y0, y1 = sorted(ax.get_ylim())
        # Tick labels matplotlib lists but does not draw (outside the view) do not count.
        texts = [t for t in ax.get_xticklabels() if x0 <= t.get_position()[0] <= x1]
        texts += [t for t in ax.get_yticklabels() if y0 <= t.get_position()[1] <= y1]
        texts += [ax.xaxis.label, ax.yaxis.label, ax.title]
        out += [
            f"label cut off: {t.get_text()!r}"
            for t in texts
            if t.get_visible() and t.get_text() and _outside(t.get_window_extent(r), width, height)
        ]
        # Where a panel stands to the right, a tick label that ends past this panel's right edge
        # runs under the neighbour's labels (the demo's slanted ``structured_output``).
        edge = ax.get_window_extent(r)
        if any(o.get_window_extent(r).x0 >= edge.x1 for o in fig.axes if o is not ax):
            out += [
                f"label {t.get_text()!r} runs into the next panel"
                for t in ax.get_xticklabels()
                if x0 <= t.get_position()[0] <= x1 and t.get_visible() and t.get_text()
                and t.get_window_extent(r).x1 > edge.x1 + 1
            ]  # fmt: skip
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(r)
        if _outside(box, width, height):
            out.append("legend cut off")
        points = [ax.transData.transform(line.get_xydata()) for line in ax.get_lines()]
        points += [
            c.get_offset_transform().transform(c.get_offsets())
            for c in ax.collections
            if np.asarray(c.get_offsets()).size
        ]
        if points:
            xy = np.vstack([p for p in points if len(p)])
            xy = xy[np.isfinite(xy).all(axis=1)]
            inside = (
                (xy[:, 0] > box.x0)
                & (xy[:, 0] < box.x1)
                & (xy[:, 1] > box.y0)
                & (xy[:, 1] < box.y1)
            )
            if inside.any():
                out.append(f"legend over {int(inside.sum())} data points of {ax.get_title()!r}")
        for patch in ax.patches:
            bb = patch.get_window_extent(r)
            if bb.width > 0 and bb.height > 0 and box.overlaps(bb):
                out.append(f"legend over a bar of {ax.get_title()!r}")
    for legend in fig.legends:
        box = legend.get_window_extent(r)
        if _outside(box, width, height):
            out.append("figure legend cut off")
        out += ["figure legend over a panel" for ax in fig.axes if box.overlaps(ax.bbox)]
    return out


@pytest.mark.parametrize("candidates", ["one", "two, with a rollout"])
def test_no_legend_over_data_no_label_cut_off(
    monkeypatch: pytest.MonkeyPatch, candidates: str
) -> None:
    drawn: list[Figure] = []
    uri = plots._uri

    def keep(fig: Figure) -> str:
        drawn.append(fig)
        return uri(fig)

    monkeypatch.setattr(plots, "_uri", keep)
    recs = sample_records() if candidates == "one" else several_with_rollout()
    figs = plots.figures(analyze(recs, MATRIX_ROWS + LOADGEN_ROWS))
    assert len(drawn) == sum(v is not None for v in figs.values()) >= 8
    found = {str(f.axes[0].get_title() or f.axes[0].get_xlabel()): problems(f) for f in drawn}
    assert not any(found.values()), found


def test_the_check_catches_a_legend_over_data_and_a_cut_label() -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=(3.0, 2.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.scatter([0.1, 0.5, 0.9], [0.95, 0.5, 0.1], label="points")
    ax.legend(loc="upper left")
    ax.set_title("a title far too long for so small a figure: its ends fall off the page")
    found = problems(fig)
    assert any(p.startswith("legend over") for p in found), found
    assert any(p.startswith("label cut off") for p in found), found


def test_the_check_catches_a_tick_label_running_into_the_next_panel() -> None:
    """The demo's acceptance panels: ``structured_output`` under the first, slanted 15° about
    its centre, ran under the second panel's labels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    def panels(**slant: Any) -> Figure:
        fig = Figure(figsize=(6.6, 3.2), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        left, right = fig.subplots(1, 2)
        left.set_xticks([1, 2, 3], ["chat", "multi_turn", "structured_output"], **slant)
        right.set_xticks([1, 2], ["<64", "64-256"], **slant)
        left.set_xlim(0.5, 3.5)  # as a box plot sets them
        right.set_xlim(0.5, 2.5)
        return fig

    found = problems(panels(rotation=15))
    assert any("'structured_output' runs into the next panel" in p for p in found), found
    assert not problems(panels(rotation=25, ha="right", rotation_mode="anchor"))


def test_no_chart_of_zeros() -> None:
    a = analyze(records(speedups={"chat": 1.4}, n=30, baseline_divergence=0.0))
    c = a.candidates["candidate-backend"]
    assert all(q.candidate_divergence.k == 0 for q in c.quality.values())
    assert plots.quality_bars(c, a.categories) is None
    some = analyze(records(speedups={"chat": 1.4}, n=30, baseline_divergence=0.2))
    assert plots.quality_bars(some.candidates["candidate-backend"], some.categories) is not None
