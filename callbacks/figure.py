"""The end-of-run figure: score-over-training curves with the phase change marked.

Drawn from the run's CSV log, so any finished run directory can be re-rendered:

    python -m callbacks.figure outputs/2026-11-22/10-00-00
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from callbacks.plots import figure_to_rgb, training_curves
from metrics.phase_change import PhaseChange, detect_phase_change

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


def render(run_dir: Path, window: int = 5) -> tuple[Path, dict[str, float]]:
    """Draw ``run_dir/phase_change.png`` and write ``run_dir/summary.json`` from the CSV log."""
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
    fig = training_curves(
        loss_first=series["loss/first_occurrence"],
        loss_repeated=series["loss/repeated"],
        top_induction=series["heads/induction/top"],
        top_prev_token=series["heads/prev_token/top"],
        circuit_raw=circuit,
        circuit_minus_baseline=series.get(f"circuit/K/{measure}_minus_baseline"),
        other_pairs_minus_baseline=[series[k] for k in composition_pairs],
        baseline=float(baseline[1][-1]) if baseline is not None else None,
        change=phase_change_of(series, "loss/repeated", True, window),
        title=f"{run_dir}",
        measure=measure,
    )
    figure_path = run_dir / FIGURE_NAME
    fig.savefig(figure_path, dpi=110)
    figure_to_rgb(fig)  # closes it
    summary = summarize(series, window)
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
    return figure_path, summary


class PhaseChangeFigure(L.Callback):
    """At the end of fit: render the figure, log it and the phase-change steps to W&B, print a summary."""

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
            figure_path, summary = render(self.run_dir, self.smoothing_window)
        except (FileNotFoundError, ValueError) as error:
            print(f"no figure: {error}")
            return
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="images/phase_change", images=[str(figure_path)], step=trainer.global_step)
                logger.experiment.summary.update(summary)
        print(f"\nfigure: {figure_path}")
        for key, value in summary.items():
            print(f"  {key:48s} {value:10.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Re-render phase_change.png and summary.json of a finished run.")
    parser.add_argument("run_dir", type=Path, help="a train.py run directory (it holds csv/metrics.csv)")
    parser.add_argument("--window", type=int, default=5, help="smoothing window, in logged points")
    args = parser.parse_args(argv)
    try:
        figure_path, summary = render(args.run_dir, args.window)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(figure_path)
    for key, value in summary.items():
        print(f"  {key:48s} {value:10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
