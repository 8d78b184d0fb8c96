"""The end-of-run validity report: which composition measure tells the truth, judged against the
K-only path ablation Built from a run's logged series, so any finished run can
be re-rendered (``python -m reports.run_report RUN_DIR``).

For each measure: the first step from which it ranks the ground-truth pair (the pair whose ablation
hurts most) first at every later ablation step, against the phase change; its final rank and
Spearman correlation with the ablation effect, and its mean Spearman after the cliff. The same four
at the writer level (writers ranked by their summed loss effect over their readers, the measure
summed likewise) and at the reader level (readers, summed over their writers): redundant readers
of one writer (two induction heads reading the same previous-token head) can flip the pair-level
rank on a 0.001 difference, not the writer-level one (:func:`metrics.ground_truth.validity.head_agreement`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from metrics.dynamics.phase_change import PhaseChange, smooth
from metrics.ground_truth.validity import LEVELS, first_step_ranked_first_for_good
from metrics.heads.circuit_scores import MATCHING
from metrics.tracked.base import registered_measures

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from reports.plots import Window

EFFECTS = {"loss_change": "repeated-token loss", "pattern_change": "attention pattern"}
COLUMNS = [
    "measure",
    "first_step_ranked_first_loss",
    "minus_phase_midpoint",
    "final_rank_loss",
    "final_spearman_loss",
    "mean_spearman_after_cliff_loss",
    "first_step_ranked_first_pattern",
    "final_spearman_pattern",
    *(
        f"{column}_{level}_loss"
        for level in LEVELS
        for column in ("first_step_ranked_first", "final_rank", "final_spearman", "mean_spearman_after_cliff")
    ),
]
"""Pair-level columns first (their order is fixed: the W&B table and tests index them), then the
writer- and reader-level ones (``first_step_ranked_first_writer_loss``, ...)."""
HEADERS = [
    "measure",
    "first for good (loss)",
    "- midpoint",
    "rank",
    "Spearman",
    "after cliff",
    "first for good (pattern)",
    "Spearman (pattern)",
    *(
        f"{name} ({level[0].upper()})"
        for level in LEVELS
        for name in ("first for good", "rank", "Spearman", "after cliff")
    ),
]
"""Console headers of ``COLUMNS``; (W) and (R) are the writer and reader levels."""
SUMMARY_COLUMNS = (
    "first_step_ranked_first_loss",
    "final_spearman_loss",
    "first_step_ranked_first_writer_loss",
    "final_rank_writer_loss",
    "final_spearman_writer_loss",
)
"""The columns a run's summary.json keeps per measure (as ``validity/{measure}/{column}``), when defined."""


def judged_measures(series) -> list[str]:
    """Measures with logged agreement (``validity/loss_change/{m}/rank_of_truth``), in the order of
    the measures' registry, the matching score last."""
    prefix, suffix = "validity/loss_change/", "/rank_of_truth"
    found = [k[len(prefix) : -len(suffix)] for k in series if k.startswith(prefix) and k.endswith(suffix)]
    order = [*registered_measures(), MATCHING]
    return sorted(found, key=lambda m: order.index(m) if m in order else len(order))


def _last(series, key) -> float:
    return float(series[key][1][-1]) if key in series else math.nan


def _first_for_good(series, effect: str, measure: str, level: str = "") -> float | None:
    """NaN when never first for good; None when the level was not logged (a run from before the head levels)."""
    key = f"validity/{effect}/{measure}/{level}rank_of_truth"
    if key not in series:
        return None
    steps, ranks = series[key]
    first = first_step_ranked_first_for_good(torch.from_numpy(steps), torch.from_numpy(ranks))
    return math.nan if first is None else first


def _mean_after(series, key: str, change: PhaseChange | None) -> float:
    """The mean of ``key`` over the steps from the end of the phase change on."""
    values = series.get(key)
    if values is None or change is None:
        return math.nan
    later = values[1][values[0] >= change.span_end]
    return float(later.mean()) if len(later) else math.nan


def validity_rows(series, change: PhaseChange | None) -> list[dict[str, object]]:
    """One row per judged measure (see ``COLUMNS``); NaN where a value does not exist (never first
    for good, no phase change, a Spearman that was undefined); None in the writer and reader
    "first for good" columns of a run that did not log those levels."""
    rows = []
    for measure in judged_measures(series):
        first = _first_for_good(series, "loss_change", measure)
        loss = f"validity/loss_change/{measure}"
        row = {
            "measure": measure,
            "first_step_ranked_first_loss": first,
            "minus_phase_midpoint": first - change.midpoint_step if change is not None else math.nan,
            "final_rank_loss": _last(series, f"{loss}/rank_of_truth"),
            "final_spearman_loss": _last(series, f"{loss}/spearman"),
            "mean_spearman_after_cliff_loss": _mean_after(series, f"{loss}/spearman", change),
            "first_step_ranked_first_pattern": _first_for_good(series, "pattern_change", measure),
            "final_spearman_pattern": _last(series, f"validity/pattern_change/{measure}/spearman"),
        }
        for level in LEVELS:
            row[f"first_step_ranked_first_{level}_loss"] = _first_for_good(series, "loss_change", measure, f"{level}_")
            row[f"final_rank_{level}_loss"] = _last(series, f"{loss}/{level}_rank_of_truth")
            row[f"final_spearman_{level}_loss"] = _last(series, f"{loss}/{level}_spearman")
            row[f"mean_spearman_after_cliff_{level}_loss"] = _mean_after(series, f"{loss}/{level}_spearman", change)
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    """Fixed-width text tables for the console: the pair level, then (after a blank line) the
    writer and reader levels, each row led by its measure, and a line saying what (W) and (R) are;
    ``never`` for a measure that never ranks the truth first for good, ``-`` for a value that does
    not exist."""
    pair_level = len(COLUMNS) - 4 * len(LEVELS)
    blocks = [range(pair_level), [0, *range(pair_level, len(COLUMNS))]]
    lines = []
    for block in blocks:
        columns, headers = [COLUMNS[i] for i in block], [HEADERS[i] for i in block]
        cells = [[row["measure"]] + [_cell(row[c], c) for c in columns[1:]] for row in rows]
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
        line = lambda items, widths=widths: "  ".join(
            item.rjust(w) if i else item.ljust(w) for i, (item, w) in enumerate(zip(items, widths))
        )
        lines += ([""] if lines else []) + [line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)]
    lines.append(
        "(W): writers, each ranked by its loss effect summed over its readers and by the measure summed "
        "likewise; (R): readers, summed over their writers"
    )
    return "\n".join(lines)


def _cell(value, column: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "never" if column.startswith("first_step") else "-"
    if column.startswith(("first_step", "minus", "final_rank")):
        return f"{value:+.0f}" if column.startswith("minus") else f"{value:.0f}"
    return f"{value:+.2f}"


def validity_figure(
    series,
    rows: list[dict[str, object]],
    change: PhaseChange | None,
    title: str,
    window: int,
    interventions: list[Window] | None = None,
) -> Figure:
    """Top: for each measure, the span over which it ranks the ground-truth pair first for good (by
    the loss effect), against the phase change. Bottom: its Spearman correlation over training,
    a moving average over ``window`` ablation steps (with few pairs a single step moves in coarse jumps)."""
    from reports.plots import mark_interventions, mark_phase_change, plt  # here: no plotting library for the table

    measures = [row["measure"] for row in rows]
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(measures)}
    fig, (ax_span, ax_rho) = plt.subplots(
        2,
        1,
        figsize=(8, 2.2 + 0.45 * len(measures) + 3.2),
        sharex=True,
        gridspec_kw={"height_ratios": [0.45 * len(measures) + 0.8, 3.2]},
    )
    last_step = max(float(series[f"validity/loss_change/{m}/rank_of_truth"][0][-1]) for m in measures)
    for y, row in enumerate(rows):
        first = row["first_step_ranked_first_loss"]
        if math.isnan(first):
            ax_span.text(0, y, "  never first for good", va="center", fontsize=8, color="0.4")
        else:
            ax_span.barh(y, last_step - first, left=first, height=0.5, color=colors[row["measure"]])
            ax_span.plot([first], [y], "k|", ms=12)
    ax_span.set_yticks(range(len(measures)), measures, fontsize=8)
    ax_span.invert_yaxis()
    ax_span.set_title(
        "ranks the ablation's top pair first from then on (K-composition; ablation = repeated-token loss)", fontsize=9
    )
    for measure in measures:
        key = f"validity/loss_change/{measure}/spearman"
        if key in series:
            steps, rho = series[key]
            ax_rho.plot(
                steps, smooth(torch.from_numpy(rho), window).numpy(), color=colors[measure], lw=1.2, label=measure
            )
    ax_rho.axhline(0, color="k", lw=0.6)
    ax_rho.set_ylim(-1.05, 1.05)
    ax_rho.set_ylabel(f"Spearman ρ with ablation effect\nover pairs (mean of {window} steps)")
    ax_rho.set_xlabel("training step")
    ax_rho.legend(fontsize=7, ncol=2, loc="lower right")
    for ax in (ax_span, ax_rho):
        mark_phase_change(ax, change)
        mark_interventions(ax, interventions, last_step)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def table_as_lists(rows: list[dict[str, object]]) -> list[list[object]]:
    """Rows as lists in ``COLUMNS`` order, NaN as None (for a W&B table)."""
    clean = lambda v: None if isinstance(v, float) and math.isnan(v) else v
    return [[clean(row[c]) for c in COLUMNS] for row in rows]
