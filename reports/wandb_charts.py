"""Charts that compare, for W&B: the circuit pair's K-composition under every measure on one chart,
and every measure's agreement with the ablation over training on another, the phase change marked.

W&B's automatic panels draw one key each, so a run shows eight separate curves where the question is
how the measures differ. These are ``wandb.plot.line_series`` custom charts (a table of
``step, lineKey, lineVal`` rows and W&B's built-in line-series Vega spec), built once at the end of
a run from its CSV series, so that they exist in the offline run file and after ``wandb sync``:

``charts/circuit_K_by_measure``
    the circuit pair's K-composition under each measure ``m``, normalised to its chance level and
    its maximum, ``(K_m - b_m) / (1 - b_m)`` with ``b_m`` the measure's random baseline
    (``comp/baseline/m``): 0 is chance, 1 is full composition (the data-aware share as it is: its
    null is 0); with the repeated-token loss over its step-0 value, so the cliff shows on the same axis
``charts/validity_spearman_by_measure``
    each measure's (and matching's) Spearman correlation with the ablation's loss effect over pairs
    (``validity/loss_change/m/spearman``)

Both carry the phase change as a horizontal segment at 1 from its onset to its end
(:data:`PHASE_CHANGE_LINE`). A sweep's report run gets two more (:func:`sweep_plots`):

``sweep/loss_curves_chart``
    every job's repeated-token loss over training, one line per job
``sweep/midpoints_chart/{setting}``
    each finished job's phase-change midpoint against a swept numeric setting (a scatter)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from metrics.dynamics.phase_change import PhaseChange

PHASE_CHANGE_LINE = "phase change (onset to end)"
LOSS_LINE = "repeated-token loss / its step-0 value"


@dataclass(frozen=True)
class LineChart:
    """Named lines ``name -> (steps, values)`` of one chart, drawn against the training step."""

    title: str
    lines: dict[str, tuple[list[float], list[float]]]


def circuit_measures(series) -> list[str]:
    """The measures with a circuit-pair K curve, in the order the CSV names them."""
    suffixes = ("_minus_baseline", "_minus_baseline_rank")
    return [
        key.removeprefix("circuit/K/") for key in series if key.startswith("circuit/K/") and not key.endswith(suffixes)
    ]


def normalised_composition(values: np.ndarray, baseline: float) -> np.ndarray:
    """``(K - b) / (1 - b)``: 0 at the measure's random baseline ``b``, 1 at full composition."""
    return (values - baseline) / (1.0 - baseline)


def phase_change_line(change: PhaseChange | None) -> dict[str, tuple[list[float], list[float]]]:
    if change is None:
        return {}
    return {PHASE_CHANGE_LINE: ([change.onset_step, change.span_end], [1.0, 1.0])}


def circuit_composition_chart(series, change: PhaseChange | None) -> LineChart | None:
    lines = {}
    for measure in circuit_measures(series):
        baseline = series.get(f"comp/baseline/{measure}")  # none for the data-aware share: its null is 0
        steps, values = series[f"circuit/K/{measure}"]
        null = float(baseline[1][-1]) if baseline is not None else 0.0
        lines[measure] = (steps.tolist(), normalised_composition(values, null).tolist())
    if not lines:
        return None
    steps, loss = series["loss/repeated"]
    lines[LOSS_LINE] = (steps.tolist(), (loss / loss[0]).tolist())
    lines.update(phase_change_line(change))
    return LineChart(
        "circuit pair's K-composition, (K - baseline) / (1 - baseline), by measure (the share: raw)", lines
    )


def validity_chart(series, change: PhaseChange | None) -> LineChart | None:
    lines = {
        key.split("/")[2]: (series[key][0].tolist(), series[key][1].tolist())
        for key in series
        if key.startswith("validity/loss_change/") and key.endswith("/spearman")
    }
    if not lines:
        return None
    lines.update(phase_change_line(change))
    return LineChart("each measure's Spearman with the ablation's loss effect over pairs", lines)


def comparison_charts(series, change: PhaseChange | None) -> dict[str, LineChart]:
    """The charts a run has the keys for, by W&B key."""
    charts = {
        "charts/circuit_K_by_measure": circuit_composition_chart(series, change),
        "charts/validity_spearman_by_measure": validity_chart(series, change),
    }
    return {key: chart for key, chart in charts.items() if chart is not None}


def line_series(chart: LineChart):
    """``chart`` as a W&B line-series custom chart: a table of ``step, lineKey, lineVal`` rows."""
    import wandb

    return wandb.plot.line_series(
        xs=[steps for steps, _ in chart.lines.values()],
        ys=[values for _, values in chart.lines.values()],
        keys=list(chart.lines),
        title=chart.title,
        xname="step",
    )


def log_charts(loggers, charts: dict[str, LineChart], step: int) -> None:
    """Log ``charts`` as W&B line-series custom charts to every W&B logger, at ``step``."""
    from lightning.pytorch.loggers import WandbLogger

    wandb_loggers = [logger for logger in loggers if isinstance(logger, WandbLogger)]
    if not wandb_loggers or not charts:
        return
    plots = {key: line_series(chart) for key, chart in charts.items()}
    for logger in wandb_loggers:
        logger.log_metrics(plots, step=step)


def job_label(job) -> str:
    """``3: model.n_heads=4 seed=1``: the job directory and its overrides."""
    return " ".join([f"{job.run_dir.name}:", *(f"{key}={value}" for key, value in job.overrides.items())])


def sweep_loss_chart(jobs) -> LineChart | None:
    """Every job's repeated-token loss (``Job.loss_curve``), one line per job."""
    lines = {job_label(job): (job.loss_curve[0].tolist(), job.loss_curve[1].tolist()) for job in jobs if job.loss_curve}
    return LineChart("repeated-token loss, every job", lines) if lines else None


def sweep_midpoints(jobs, setting: str) -> list[tuple[float, float]]:
    """``(setting's value, phase-change midpoint)`` of every job with a numeric value and a midpoint."""
    points = []
    for job in jobs:
        midpoint = job.values.get("phase_change_midpoint", math.nan)
        try:
            value = float(job.overrides.get(setting, ""))
        except ValueError:
            continue
        if isinstance(midpoint, (int, float)) and math.isfinite(midpoint):
            points.append((value, float(midpoint)))
    return points


def sweep_plots(jobs, settings: list[str]) -> dict:
    """The sweep report run's charts, by W&B key: the loss curves and a midpoint scatter per setting."""
    import wandb

    plots = {}
    chart = sweep_loss_chart(jobs)
    if chart is not None:
        plots["sweep/loss_curves_chart"] = line_series(chart)
    for setting in settings:
        points = sweep_midpoints(jobs, setting)
        if points:
            table = wandb.Table(columns=[setting, "phase_change_midpoint"], data=[list(p) for p in points])
            plots[f"sweep/midpoints_chart/{setting}"] = wandb.plot.scatter(
                table, setting, "phase_change_midpoint", title=f"phase-change midpoint vs {setting}"
            )
    return plots
