"""The end-of-run report: score-over-training curves with the phase change marked, the summary,
(when the run tracked the ablation) the validity table and figure (:mod:`reports.validity_table`), and
(when the run kept a tensor store, :mod:`records.tensor_store`) the final composition heatmaps.

Drawn from the run's CSV log and ``tensors/`` store, so any finished run directory can be re-rendered.
The grey "other pairs" curves come from the store when it holds the plotted measure (a big model
logs no per-pair keys), else from the CSV's per-pair keys, else from its max and mean over pairs:

    python -m reports.run_report outputs/2026-11-22/10-00-00
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from metrics.dynamics.phase_change import (
    SMALLEST_PHASE_CHANGE,
    SMOOTHING_WINDOW,
    NoPhaseChange,
    PhaseChange,
    find_phase_change,
)
from metrics.tracked.base import registered_measures, tracked_quantities
from metrics.tracked.probe_views import INTERVENTION_OFF
from records.keys import scored_flat_indices
from records.layout import (
    COMPOSITION_FIGURE,
    CSV_RELATIVE_PATH,
    HEADS_FIGURE,
    HYDRA_CONFIG,
    HYDRA_DIR,
    INTERVENTION_RECORD,
    PHASE_CHANGE_FIGURE,
    STRATEGIES_FIGURE,
    SUMMARY_NAME,
    TENSORS_DIR,
    VALIDITY_FIGURE,
    VALIDITY_TABLE,
    DamagedFile,
    figure_title,
)
from records.tables import write_rows
from records.tensor_store import read_tensor_store
from records.trajectory import Trajectory, TrajectoryError
from reports import validity_table as validity
from reports.forecast_report import forecast_line, forecast_summary
from reports.head_types import SUMMARY_KEYS as HEAD_SUMMARY_KEYS
from reports.head_types import head_lines, head_summary, heads_figure, read_head_history, reader_behaviour
from reports.strategy_timeline import (
    generic_strategies,
    read_timeline,
    timeline_figure,
    timeline_summary,
    without_false_cliff,
)
from reports.wandb_charts import LineChart, comparison_charts

MAX_GREY_CURVES = 100
"""More pairs than this: draw the range over all pairs and only this many curves, the highest peaks."""


def read_series(csv_path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every column of a Lightning CSV log as ``(steps, values)``, blank cells dropped. A last row cut
    short (a run killed while writing it, a full disk) is left out, said in one line; any other row that
    cannot be read makes it :class:`DamagedFile`."""
    columns: dict[str, tuple[list[float], list[float]]] = {}
    with open(csv_path, newline="") as handle:
        try:
            rows = list(csv.DictReader(handle))
        except (csv.Error, UnicodeDecodeError) as error:
            raise DamagedFile(csv_path, error) from None
    for number, row in enumerate(rows):
        try:
            step = float(row["step"])
            cells = [(key, float(cell)) for key, cell in row.items() if key != "step" and cell not in ("", None)]
        except (ValueError, TypeError, KeyError) as error:
            if number == len(rows) - 1:
                print(f"{csv_path}: its last row is cut short; read without it", file=sys.stderr)
                break
            raise DamagedFile(csv_path, f"row {number + 2}: {error}") from None
        for key, value in cells:
            steps, values = columns.setdefault(key, ([], []))
            steps.append(step)
            values.append(value)
    return {key: (np.array(steps), np.array(values)) for key, (steps, values) in columns.items()}


def plotted_measure(series) -> str:
    """Frobenius if it was tracked, else the first tracked measure (from ``comp/baseline/*`` keys)."""
    tracked = [k.split("/")[2] for k in series if k.startswith("comp/baseline/") and not k.endswith("_stderr")]
    return "frobenius" if "frobenius" in tracked or not tracked else tracked[0]


def phase_change_of(series, key: str, falling: bool, window: int) -> PhaseChange | None:
    """The phase change of ``series[key]`` (None: none, or the run did not log the key)."""
    found = phase_change_or_why(series, key, falling, window)
    return found if isinstance(found, PhaseChange) else None


def phase_change_or_why(series, key: str, falling: bool, window: int) -> PhaseChange | NoPhaseChange:
    """The phase change of ``series[key]``, or why there is none (:func:`metrics.dynamics.phase_change.find_phase_change`)."""
    if key not in series:
        return NoPhaseChange(f"the run logged no {key}")
    steps, values = series[key]
    return find_phase_change(
        torch.from_numpy(steps),
        torch.from_numpy(values),
        falling=falling,
        window=window,
        min_change=SMALLEST_PHASE_CHANGE.get(key, 0.0),
    )


def summarize(series, window: int) -> dict[str, float]:
    """Final values and phase-change steps of a run, from its logged series: the keys each tracked
    quantity names for them (its ``summary`` and ``phase_changes``)."""
    quantities = tracked_quantities().values()
    summary: dict[str, float] = {}
    for told in (key for quantity in quantities for key in quantity.summary):
        for key in [k for k in series if k.startswith(told)] if told.endswith("/") else [told]:  # "/": a prefix
            if key in series:
                summary[f"final/{key}"] = float(series[key][1][-1])
    for name, (key, falling) in ((n, change) for q in quantities for n, change in q.phase_changes.items()):
        if key not in series:
            continue  # a key this task does not log (induction on chains)
        change = phase_change_or_why(series, key, falling, window)
        if isinstance(change, NoPhaseChange):
            summary[f"phase_change/{name}_why"] = f"no phase change of {key}: {change.reason}"
            continue
        summary[f"phase_change/{name}_onset_step"] = change.onset_step
        summary[f"phase_change/{name}_midpoint_step"] = change.midpoint_step
        if change.finished:
            summary[f"phase_change/{name}_end_step"] = change.end_step
        else:
            summary[f"phase_change/{name}_why"] = (
                f"{key} was still changing at the last step, {change.last_step:.0f}: the phase change's end is"
                " beyond the run (onset and midpoint are those of the change so far)"
            )
        summary[f"phase_change/{name}_from_value"] = change.start_value
        summary[f"phase_change/{name}_to_value"] = change.end_value
    return summary


@dataclass(frozen=True)
class OtherPairs:
    """What the composition panel draws besides the circuit pair."""

    curves: list[tuple[np.ndarray, np.ndarray]]  # (steps, values minus baseline), grey
    label: str = "other pairs, minus baseline"
    band: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (steps, low, high) over all pairs


def other_pairs(series, store_dir: Path, measure: str) -> OtherPairs:
    """The grey curves of ``measure``'s K-composition minus baseline: from the store if it holds
    ``comp/K/{measure}``, else the CSV's per-pair keys, else the CSV's max and mean over pairs."""
    names = [f"comp/K/{measure}", f"comp/baseline/{measure}"]
    stored = read_tensor_store(store_dir, names, mmap=True) if store_dir.is_dir() else {}
    steps, values = stored.get(f"comp/K/{measure}", ((), ()))
    baseline = baseline_mean(series, stored, measure)
    if len(steps) and baseline is not None:
        return stored_other_pairs(steps.astype(np.float64), values, baseline)
    per_pair = [series[k] for k in series if k.startswith(f"comp/K/{measure}_minus_baseline/") and "->" in k]
    if per_pair:
        return OtherPairs(per_pair)
    summary = [
        series[k]
        for k in (f"comp/K/{measure}_minus_baseline/max", f"comp/K/{measure}_minus_baseline/mean")
        if k in series
    ]
    return OtherPairs(summary, "max and mean over pairs, minus baseline")


def baseline_mean(series, stored, measure: str) -> float | None:
    """The measure's last baseline: from the CSV (float64, as the logged ``_minus_baseline`` keys),
    else from the store (``comp/baseline/{measure}`` = (mean, stderr)); None if neither has it."""
    if f"comp/baseline/{measure}" in series:
        return float(series[f"comp/baseline/{measure}"][1][-1])
    steps, values = stored.get(f"comp/baseline/{measure}", ((), ()))
    return float(values[-1][0]) if len(steps) else None


def stored_other_pairs(
    steps: np.ndarray, values: np.ndarray, baseline: float, max_curves: int = MAX_GREY_CURVES
) -> OtherPairs:
    """``values [n, L, H, L, H]`` (NaN where the reader is not later) -> one curve per scored pair
    minus ``baseline``; beyond ``max_curves`` pairs the range over all of them, and the curves of
    the ``max_curves`` with the highest peak."""
    n, L, H = values.shape[:3]
    scored = np.asarray(values.reshape(n, -1)[:, scored_flat_indices(L, H)], dtype=np.float64) - baseline  # [n, P]
    if scored.shape[1] <= max_curves:
        return OtherPairs([(steps, scored[:, p]) for p in range(scored.shape[1])])
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmax of an all-NaN slice warns; NaN is the answer
        peaks = np.nan_to_num(np.nanmax(scored, axis=0), nan=-np.inf)
        band = (steps, np.nanmin(scored, axis=1), np.nanmax(scored, axis=1))
    highest = np.argsort(-peaks, kind="stable")[:max_curves]
    label = f"other pairs, minus baseline: the {max_curves} of {scored.shape[1]} with the highest peak"
    return OtherPairs([(steps, scored[:, p]) for p in highest], label, band)


def tracked_measures(names) -> list[str]:
    """Measures with a stored ``comp/{kind}/{measure}`` among ``names``, in the registry's order."""
    found = {name.split("/")[2] for name in names if name.startswith("comp/") and not name.startswith("comp/baseline/")}
    order = list(registered_measures())
    return sorted(found, key=lambda m: (order.index(m) if m in order else len(order), m))


def final_composition(store_dir: Path, series) -> tuple[dict[str, dict[str, np.ndarray]], int] | None:
    """``({measure: {kind: [L, H, L, H] minus baseline}}, step)`` at the last stored step of every
    tracked measure; None without a store or measures."""
    by_measure, last_step = {}, None
    stored = read_tensor_store(store_dir, mmap=True) if store_dir.is_dir() else {}
    for measure in tracked_measures(stored):
        baseline = baseline_mean(series, stored, measure)
        if baseline is None:
            continue
        kinds = {}
        for kind in ("Q", "K", "V"):
            steps, values = stored.get(f"comp/{kind}/{measure}", ((), ()))
            if len(steps) and values.shape[1] >= 2:  # one layer: nothing to draw
                kinds[kind] = np.asarray(values[-1], dtype=np.float64) - baseline
                last_step = int(steps[-1]) if last_step is None else max(last_step, int(steps[-1]))
        if kinds:
            by_measure[measure] = kinds
    return (by_measure, last_step) if by_measure else None


@dataclass(frozen=True)
class RunReport:
    run_dir: Path
    summary: dict[str, float]
    figure: Path | None = None  # phase_change.png; None when the run drew no figures (figures=false)
    validity_figure: Path | None = None  # None when the run did not track the ablation or drew no figures
    validity_rows: list[dict[str, object]] | None = None
    no_validity_because: str | None = None  # why there is no validity table, when there is none
    composition_figure: Path | None = None  # None when the run kept no tensor store or drew no figures
    strategies_figure: Path | None = None  # None when the run tracked no strategies or drew no figures
    heads_figure: Path | None = None  # None when the run tracked no head behaviours or drew no figures
    charts: dict[str, LineChart] = field(default_factory=dict)  # W&B's comparison charts, by key


def render(run_dir: Path, window: int, figures: bool = True, meanwhile: Callable[[], None] | None = None) -> RunReport:
    """Write ``run_dir/summary.json`` from the CSV log (and the store's pair curves), with a tracked
    ablation also ``validity.csv``; with ``figures`` draw ``phase_change.png``, and where the run has
    what they show ``validity.png``, ``composition.png`` (a tensor store), ``strategies.png`` and
    ``heads.png``. Without ``figures`` every number is the same and no figure is drawn. ``meanwhile``:
    begun here once the figures are being drawn (after the tables are written)."""
    from reports.plots import composition_report, draw_figures  # here: reading a run loads no plotting library

    csv_path = run_dir / CSV_RELATIVE_PATH
    if not csv_path.is_file() or csv_path.stat().st_size == 0:
        raise FileNotFoundError(f"no CSV log at {csv_path}: is {run_dir} a finished train.py run directory?")
    series = read_series(csv_path)
    if "loss/repeated" not in series:
        raise ValueError(f"{csv_path} has no tracker metrics (was the run made with tracker.enabled=false?)")
    store_dir = run_dir / TENSORS_DIR
    measure = plotted_measure(series)
    change = phase_change_of(series, "loss/repeated", True, window)
    final = final_composition(store_dir, series)
    summary = summarize(series, window)
    timeline = read_timeline(series, store_dir)
    if timeline is not None:
        summary.update(timeline_summary(timeline))
    task = config_value(run_dir, "data.name")
    summary = without_false_cliff(summary, timeline, generic_strategies(task))
    summary.update(forecast_summary(series, summary.get("phase_change/loss_midpoint_step")))
    history = read_head_history(store_dir, reader_behaviour(task))
    if history is not None:
        summary.update(head_summary(history))
    rows = validity.validity_rows(series, change)
    for row in rows:
        for column in validity.SUMMARY_COLUMNS:
            if row[column] is not None and not math.isnan(
                row[column]
            ):  # a measure never first for good has no such step; older runs lack the head levels
                summary[f"validity/{row['measure']}/{column}"] = row[column]
    summary.update(trajectory_summary(run_dir, series, change))
    summary.update(intervention_summary(run_dir))

    # every figure the run has the data for, the dearest first: drawn side by side while the tables are written
    label = figure_title(run_dir)
    drawings = []
    if final is not None:
        by_measure, step = final
        title = f"composition minus baseline at step {step}: {label}"
        drawings.append((partial(composition_report, by_measure, title), run_dir / COMPOSITION_FIGURE))
    if history is not None:
        drawings.append((partial(heads_figure, history, f"what every head becomes: {label}"), run_dir / HEADS_FIGURE))
    drawings.append((partial(phase_change_figure, run_dir, series, measure, change), run_dir / PHASE_CHANGE_FIGURE))
    if rows:
        title = f"which measure tells the truth: {label}"
        windows = intervention_windows(run_dir)
        drawing = partial(validity.validity_figure, series, rows, change, title, window, windows)
        drawings.append((drawing, run_dir / VALIDITY_FIGURE))
    if timeline is not None:
        title = f"which strategy the model uses: {label}"
        drawings.append((partial(timeline_figure, timeline, title), run_dir / STRATEGIES_FIGURE))

    def write_tables() -> None:
        if rows:
            write_rows(run_dir / VALIDITY_TABLE, rows, validity.COLUMNS)
        (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
        if meanwhile is not None:
            meanwhile()

    draw_figures(drawings if figures else [], then=write_tables)
    drawn = {path.name: path for _, path in drawings} if figures else {}
    because = None
    if not rows:
        because = (
            "the ablation was off (tracker.ablation.every_n_steps=0)"
            if has_pairs(series, final)
            else "the model has no earlier->later head pairs (one layer)"
        )
    return RunReport(
        run_dir,
        summary,
        drawn.get(PHASE_CHANGE_FIGURE),
        drawn.get(VALIDITY_FIGURE),
        rows or None,
        because,
        drawn.get(COMPOSITION_FIGURE),
        drawn.get(STRATEGIES_FIGURE),
        drawn.get(HEADS_FIGURE),
        comparison_charts(series, change),
    )


def phase_change_figure(run_dir: Path, series, measure: str, change: PhaseChange | None):
    """The report's main figure (:func:`reports.plots.training_curves`) from the run's series."""
    from reports.plots import training_curves

    others = other_pairs(series, run_dir / TENSORS_DIR, measure)
    reader = "induction" if "heads/induction/top" in series else "statistical_induction"  # the task's prefix matching
    circuit = series.get(f"circuit/K/{measure}")
    baseline = series.get(f"comp/baseline/{measure}")
    return training_curves(
        loss_first=series["loss/first_occurrence"],
        loss_repeated=series["loss/repeated"],
        top_induction=series[f"heads/{reader}/top"],
        top_prev_token=series["heads/prev_token/top"],
        circuit_raw=circuit,
        circuit_minus_baseline=series.get(f"circuit/K/{measure}_minus_baseline"),
        other_pairs_minus_baseline=others.curves,
        baseline=float(baseline[1][-1]) if baseline is not None else None,
        change=change,
        title=figure_title(run_dir),
        measure=measure,
        other_pairs_label=others.label,
        other_pairs_band=others.band,
        reader=reader,
        shares={
            part: series[key]
            for part, key in (
                ("writer", "circuit/K/share"),
                ("tokens", "circuit/share/K/tokens"),
                ("positions", "circuit/share/K/positions"),
            )
            if key in series
        },
        interventions=intervention_windows(run_dir),
        intervention_off={
            key.removeprefix(INTERVENTION_OFF): value
            for key, value in series.items()
            if key.startswith(INTERVENTION_OFF)
        },
    )


def read_intervention(run_dir: Path) -> dict:
    """The run's ``intervention.json`` (callbacks/interventions.py), {} for a run without one."""
    try:
        return json.loads((run_dir / INTERVENTION_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def intervention_windows(run_dir: Path) -> list[tuple[int, int | None, str]]:
    """``(from_step, until_step, label)`` of each of the run's interventions."""
    return [(i["from_step"], i["until_step"], i["label"]) for i in read_intervention(run_dir).get("interventions", [])]


def intervention_summary(run_dir: Path) -> dict[str, str]:
    """``intervention``: what the run did to its heads while it trained (``none``), as resolved."""
    return {"intervention": read_intervention(run_dir).get("description", "none")}


def trajectory_summary(run_dir: Path, series, change: PhaseChange | None) -> dict[str, float]:
    """What the run's weight trajectory kept: its steps (all and adaptive), its size, and whether
    every tracker step from the phase change's onset to its end is among them (1 or 0)."""
    try:
        trajectory = Trajectory(run_dir)
    except TrajectoryError:
        return {}
    entries = trajectory.entries
    summary = {
        "trajectory/steps": len(entries),
        "trajectory/adaptive_steps": sum("adaptive" in e["reasons"] for e in entries.values()),
        "trajectory/megabytes": sum(e["bytes"] for e in entries.values()) / 2**20,
    }
    if change is not None:
        tracked = series["loss/repeated"][0]
        inside = [int(s) for s in tracked if change.onset_step <= s <= change.span_end]
        summary["trajectory/phase_change_covered"] = float(all(s in entries for s in inside))
    return summary


def has_pairs(series, final) -> bool:
    """Whether the run scored any earlier->later pair: per-pair keys, summary-mode keys
    (``comp/K/{m}/max``) or stored composition."""
    logged = any(k.startswith("comp/") and ("->" in k or k.endswith("/max")) for k in series)
    return logged or final is not None


def print_report(report: RunReport) -> None:
    if report.figure is not None:
        print(f"\nfigure: {report.figure}")
    else:
        print(f"\nno figures (figures=false): python -m reports.run_report {report.run_dir} draws them")
    if report.composition_figure is not None:
        print(f"final composition: {report.composition_figure}")
    if report.strategies_figure is not None:
        print(f"strategy timeline: {report.strategies_figure}")
    if report.heads_figure is not None:
        print(f"every head: {report.heads_figure}")
        for line in head_lines(report.summary):
            print(f"  {line}")
    if line := forecast_line(report.summary):
        print(line)
    for key, value in report.summary.items():
        if key.startswith((*HEAD_SUMMARY_KEYS, "forecast/")):
            continue  # told per head, and the forecast in its line, above
        if isinstance(value, str):
            print(f"  {key:48s} {value}")
        elif not key.startswith("validity/"):
            print(f"  {key:48s} {value:10.4f}")
    if report.validity_rows:
        print(f"\nwhich measure tells the truth (K-only path ablation; table {report.run_dir / VALIDITY_TABLE}):")
        print(validity.format_table(report.validity_rows))
        if report.validity_figure is not None:
            print(f"figure: {report.validity_figure}")
    else:
        print(f"no validity table: {report.no_validity_because}")


def config_value(run_dir: Path, key: str):
    """The value of ``key`` (dotted) in the config the run was trained with (its ``.hydra/config.yaml``),
    None for a directory without one (a re-scoring's) or a config without the key."""
    from omegaconf import OmegaConf

    config = Path(run_dir) / HYDRA_DIR / HYDRA_CONFIG
    if not config.is_file():
        return None
    try:
        return OmegaConf.select(OmegaConf.load(config), key)
    except Exception as error:  # OmegaConf's YAML and grammar errors share no base class
        raise DamagedFile(config, error) from None


def smoothing_window_of(run_dir: Path) -> int:
    """The ``tracker.smoothing_window`` the run was trained with, or the default for a directory
    without its config (a re-scoring's)."""
    window = config_value(run_dir, "tracker.smoothing_window")
    return int(window) if window is not None else SMOOTHING_WINDOW


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Re-render phase_change.png, summary.json, composition.png and the validity table and figure of a finished run."
    )
    parser.add_argument("run_dir", type=Path, help="a train.py run directory (it holds csv/metrics.csv)")
    parser.add_argument(
        "--window", type=int, default=None, help="smoothing window, in logged points (default: the run's own)"
    )
    args = parser.parse_args(argv)
    try:
        report = render(args.run_dir, args.window or smoothing_window_of(args.run_dir))
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
