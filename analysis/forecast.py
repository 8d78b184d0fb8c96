"""Fit a phase-change forecaster on a sweep, for later runs to use (``tracker.forecaster=FILE``).

    python -m analysis.forecast fit SWEEP_DIR [--out FILE] [--no-law]

Reads every finished job's repeated-token loss and precursors (``csv/metrics.csv``) and its midpoint
(``summary.json``), fits :func:`metrics.dynamics.forecast.fit_forecaster` (with the prior of a power law
in the sweep's numeric settings, unless ``--no-law``) and writes ``SWEEP_DIR/forecaster.json`` (or
``--out``, a new file: an existing one is refused). The forecaster is for runs of the sweep's task and
model shape; a run of another is refused before it trains. docs/forecast.md says how well it does on
runs it was not fitted on (``python -m bench.forecast_validity``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from metrics.dynamics.forecast import (
    SERIES,
    Forecaster,
    History,
    PriorLaw,
    fit_forecaster,
    fit_prior_law,
    shape_of,
)
from records.layout import CSV_RELATIVE_PATH, FORECASTER
from records.outputs import foreign_out
from records.status import FINISHED
from reports.run_report import read_series
from reports.sweep_report import SEED_KEYS, Job, keys_varying_across, read_jobs

MIDPOINT_COLUMN = "phase_change_midpoint"


def task_of(config: dict) -> str:
    return str(config.get("data", {}).get("name", "?"))


def history_of(job: Job) -> History | None:
    """The job's series and midpoint (None: it did not finish, or logged no repeated-token loss)."""
    if job.status != FINISHED:
        return None
    path = job.run_dir / CSV_RELATIVE_PATH
    try:
        columns = read_series(path)
    except (OSError, ValueError) as error:
        print(f"{path}: unreadable ({error}); its job left out", file=sys.stderr)
        return None
    if SERIES[0] not in columns:
        return None
    steps, loss = columns[SERIES[0]]
    series = {SERIES[0]: loss}
    for key in SERIES[1:]:
        if key in columns and np.array_equal(columns[key][0], steps):
            series[key] = columns[key][1]
    midpoint = job.values.get(MIDPOINT_COLUMN)
    midpoint = float(midpoint) if isinstance(midpoint, (int, float)) and math.isfinite(midpoint) else None
    max_steps = float(job.config.get("trainer", {}).get("max_steps", steps[-1]))
    return History(steps, series, max_steps, dict(job.overrides), midpoint)


def swept_settings(jobs: list[Job]) -> tuple[list[str], list[str]]:
    """The swept settings (seeds aside): those whose every value is a positive number, and the others."""
    swept = [k for k in keys_varying_across(jobs) if k not in SEED_KEYS]

    def positive(text: str) -> bool:
        try:
            return float(text) > 0
        except (TypeError, ValueError):
            return False

    numeric = [k for k in swept if all(positive(job.overrides.get(k, "")) for job in jobs)]
    return numeric, [k for k in swept if k not in numeric]


def prior_law_of(jobs: list[Job], histories: list[History]) -> PriorLaw | None:
    """The power law of the jobs' midpoints in their numeric swept settings (censored at ``max_steps``);
    a job whose overrides lack one of them (a damaged ``overrides.yaml``) is left out of the law."""
    numeric, strata = swept_settings(jobs)
    complete = [h for h in histories if all(k in h.settings for k in (*numeric, *strata))]
    return fit_prior_law(
        [h.settings for h in complete],
        [h.midpoint if h.midpoint is not None else h.max_steps for h in complete],
        [h.midpoint is None for h in complete],
        numeric,
        strata,
    )


def fit_sweep(jobs: list[Job], law: bool = True) -> Forecaster:
    """A forecaster from ``jobs`` (ValueError, one line, where they mix tasks or shapes, or none has a
    midpoint)."""
    pairs = [(job, h) for job in jobs if job.config and (h := history_of(job)) is not None]
    if not pairs:
        raise ValueError("no finished job with a readable config logged the repeated-token loss")
    return fit_sweep_histories([p[0] for p in pairs], [p[1] for p in pairs], law)


def fit_sweep_histories(
    jobs: list[Job], histories: list[History], law: bool = True, along: list[np.ndarray] | None = None
) -> Forecaster:
    """:func:`fit_sweep` from the jobs' histories (``along``: their features, where computed)."""
    tasks = {task_of(job.config) for job in jobs}
    shapes = {tuple(sorted(shape_of(job.config.get("model", {})).items())) for job in jobs}
    if len(tasks) > 1 or len(shapes) > 1:
        raise ValueError(
            f"the sweep mixes tasks or model shapes ({len(tasks)} tasks, {len(shapes)} shapes): fit one forecaster each"
        )
    prior = prior_law_of(jobs, histories) if law else None
    return fit_forecaster(histories, tasks.pop(), dict(shapes.pop()), prior, along=along)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.forecast", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="fit a forecaster on a sweep's runs")
    fit.add_argument("sweep_dir", type=Path)
    fit.add_argument("--out", type=Path, default=None, help=f"a new file (default: SWEEP_DIR/{FORECASTER})")
    fit.add_argument("--no-law", action="store_true", help="without the prior of the sweep's power law")
    args = parser.parse_args(argv)
    out = args.out or args.sweep_dir / FORECASTER
    if why := foreign_out(out, '"kind": "phase_change_forecaster"'):
        print(f"error: {why}", file=sys.stderr)
        return 2
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        jobs = read_jobs([args.sweep_dir])
        forecaster = fit_sweep(jobs, law=not args.no_law)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    forecaster.save(out)
    law = forecaster.law
    print(
        f"forecaster for {forecaster.task} {forecaster.shape}: {forecaster.runs} runs, {forecaster.rows} snapshots;"
        f" 80 % of its residuals within x{math.exp(np.quantile(forecaster.residuals, 0.1)):.2f}"
        f"-x{math.exp(np.quantile(forecaster.residuals, 0.9)):.2f} of the midpoint"
        + (f"; prior law exponents {', '.join(f'{k} {a:+.2f}' for k, a in law.exponents.items())}" if law else "")
    )
    print(f"written: {out}  (use: python train.py ... tracker.forecaster={out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
