"""The end-of-run report: score-over-training curves with the phase change marked, the summary,
and (when the run tracked the ablation) the validity table and figure (:mod:`callbacks.validity`).

Drawn from the run's CSV log, so any finished run directory can be re-rendered:

    python -m callbacks.figure outputs/2026-11-22/10-00-00
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from callbacks import validity
from callbacks.plots import figure_to_rgb, training_curves
from metrics.dynamics.phase_change import PhaseChange, detect_phase_change

FIGURE_NAME = "phase_change.png"
SUMMARY_NAME = "summary.json"
CSV_RELATIVE_PATH = Path("csv") / "metrics.csv"


def read_series(csv_path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every column of a Lightning CSV log as ``(steps, values)``, blank cells dropped."""
    columns: dict[str, tuple[list[float], list[float]]] = {}
    with open(csv_path, newline="") as handle:
        for row in csv.DictReader(handle):
            step = float(row["step"])
            for key, cell in row.items():
                if key != "step" and cell not in ("", None):
                    steps, values = columns.setdefault(key, ([], []))
                    steps.append(step)
                    values.append(float(cell))
    return {key: (np.array(steps), np.array(values)) for key, (steps, values) in columns.items()}


def plotted_measure(series) -> str:
    """Frobenius if it was tracked, else the first tracked measure (from ``comp/baseline/*`` keys)."""
    tracked = [k.split("/")[2] for k in series if k.startswith("comp/baseline/") and not k.endswith("_stderr")]
    return "frobenius" if "frobenius" in tracked or not tracked else tracked[0]


def phase_change_of(series, key: str, falling: bool, window: int) -> PhaseChange | None:
    if key not in series:
        return None
    steps, values = series[key]
    return detect_phase_change(torch.from_numpy(steps), torch.from_numpy(values), falling=falling, window=window)


def summarize(series, window: int = 5) -> dict[str, float]:
    """Final values and phase-change steps of a run, from its logged series."""
    summary: dict[str, float] = {}
    for key in ("loss/repeated", "loss/first_occurrence", "heads/induction/top", "heads/prev_token/top",
                "circuit/K/frobenius", "circuit/K/frobenius_minus_baseline", "circuit/K/frobenius_minus_baseline_rank"):
        if key in series:
            summary[f"final/{key}"] = float(series[key][1][-1])
    for name, key, falling in (("loss", "loss/repeated", True), ("induction", "heads/induction/top", False)):
        change = phase_change_of(series, key, falling, window)
        if change is not None:
            summary[f"phase_change/{name}_onset_step"] = change.onset_step
            summary[f"phase_change/{name}_midpoint_step"] = change.midpoint_step
            summary[f"phase_change/{name}_end_step"] = change.end_step
            summary[f"phase_change/{name}_from_value"] = change.start_value
            summary[f"phase_change/{name}_to_value"] = change.end_value
    return summary


@dataclass(frozen=True)
class RunReport:
    figure: Path
    summary: dict[str, float]
    validity_figure: Path | None = None  # None when the run did not track the ablation
    validity_rows: list[dict[str, object]] | None = None
    no_validity_because: str | None = None  # why there is no validity table, when there is none


def render(run_dir: Path, window: int = 5) -> RunReport:
    """Draw ``run_dir/phase_change.png`` and write ``run_dir/summary.json`` from the CSV log; with
    a tracked ablation also ``validity.png`` and ``validity.csv``."""
    csv_path = run_dir / CSV_RELATIVE_PATH
    if not csv_path.is_file() or csv_path.stat().st_size == 0:
        raise FileNotFoundError(f"no CSV log at {csv_path}: is {run_dir} a finished train.py run directory?")
    series = read_series(csv_path)
    if "loss/repeated" not in series:
        raise ValueError(f"{csv_path} has no tracker metrics (was the run made with tracker.enabled=false?)")
    measure = plotted_measure(series)
    composition_pairs = [k for k in series if k.startswith(f"comp/K/{measure}_minus_baseline/")]
    circuit = series.get(f"circuit/K/{measure}")
    baseline = series.get(f"comp/baseline/{measure}")
    change = phase_change_of(series, "loss/repeated", True, window)
    fig = training_curves(
        loss_first=series["loss/first_occurrence"],
        loss_repeated=series["loss/repeated"],
        top_induction=series["heads/induction/top"],
        top_prev_token=series["heads/prev_token/top"],
        circuit_raw=circuit,
        circuit_minus_baseline=series.get(f"circuit/K/{measure}_minus_baseline"),
        other_pairs_minus_baseline=[series[k] for k in composition_pairs],
        baseline=float(baseline[1][-1]) if baseline is not None else None,
        change=change,
        title=f"{run_dir}",
        measure=measure,
    )
    figure_path = run_dir / FIGURE_NAME
    fig.savefig(figure_path, dpi=110)
    figure_to_rgb(fig)  # closes it
    summary = summarize(series, window)
    rows = validity.validity_rows(series, change)
    validity_path = None
    if rows:
        validity.write_table(rows, run_dir / validity.TABLE_NAME)
        fig = validity.validity_figure(series, rows, change, f"which measure tells the truth: {run_dir}", window)
        validity_path = run_dir / validity.FIGURE_NAME
        fig.savefig(validity_path, dpi=110)
        figure_to_rgb(fig)
        for row in rows:
            for column in ("first_step_ranked_first_loss", "final_spearman_loss"):
                if not math.isnan(row[column]):  # a measure never first for good has no such step
                    summary[f"validity/{row['measure']}/{column}"] = row[column]
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
    because = None
    if not rows:
        has_pairs = any(k.startswith("comp/") and "->" in k for k in series)
        because = "the ablation was off (tracker.ablation_every_n_steps=0)" if has_pairs else "the model has no earlier->later head pairs (one layer)"
    return RunReport(figure_path, summary, validity_path, rows or None, because)


def print_report(report: RunReport) -> None:
    print(f"\nfigure: {report.figure}")
    for key, value in report.summary.items():
        if not key.startswith("validity/"):
            print(f"  {key:48s} {value:10.4f}")
    if report.validity_rows:
        print(f"\nwhich measure tells the truth (K-only path ablation; table {report.figure.parent / validity.TABLE_NAME}):")
        print(validity.format_table(report.validity_rows))
        print(f"figure: {report.validity_figure}")
    else:
        print(f"no validity table: {report.no_validity_because}")


class PhaseChangeFigure(L.Callback):
    """At the end of fit: render the report, log its figures, validity table and summary to W&B, print it."""

    def __init__(self, run_dir: Path, smoothing_window: int = 5) -> None:
        self.run_dir = Path(run_dir)
        self.smoothing_window = smoothing_window

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                logger.save()  # flush rows still buffered
        try:
            report = render(self.run_dir, self.smoothing_window)
        except (FileNotFoundError, ValueError) as error:
            print(f"no figure: {error}")
            return
        step = trainer.global_step
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="images/phase_change", images=[str(report.figure)], step=step)
                if report.validity_rows:
                    logger.log_image(key="images/validity", images=[str(report.validity_figure)], step=step)
                    logger.log_table(key="validity/table", columns=validity.COLUMNS,
                                     data=validity.table_as_lists(report.validity_rows), step=step)
                logger.experiment.summary.update(report.summary)
        print_report(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Re-render phase_change.png, summary.json and the validity table and figure of a finished run.")
    parser.add_argument("run_dir", type=Path, help="a train.py run directory (it holds csv/metrics.csv)")
    parser.add_argument("--window", type=int, default=5, help="smoothing window, in logged points")
    args = parser.parse_args(argv)
    try:
        report = render(args.run_dir, args.window)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
