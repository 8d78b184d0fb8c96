"""How well the phase change's forecast (:mod:`metrics.dynamics.forecast`) does on runs it was not fitted on.

Every forecast is replayed from the runs' own files, snapshot by snapshot, as the tracker makes it
(``callbacks/phase_change_forecast.py``). The runs of the sweeps given are pooled (one task, one shape)
and split two ways:

- **held-out seeds**: each seed in turn is left out; the forecaster is fitted on the other seeds' runs and
  judged on the left-out seed's;
- **held-out cells**: each cell (one combination of the swept settings) in turn is left out, all its seeds.

At 25 / 50 / 75 % of the way to each judged run's true midpoint (the last forecast made by then), the
relative error ``forecast / midpoint − 1`` and whether the 80 % interval covers the midpoint, for five
forecasters: the model-free rule; the fitted forecaster with and without the prior law; and two
baselines, the prior law alone (the run's settings, its interval ``exp(±1.28 σ)``) and the training
runs' median midpoint (interval: their 10-90 % range). ``--controls``: runs without a cliff (one layer,
layer 0 ablated, a learning rate too small): how many get a false alarm, a forecast midpoint before
``max_steps`` with ``p_before_end ≥ 0.8`` at any snapshot. ``--moved``: runs whose phase change an
intervention moved (``intervention=clamp_prev_token``): the errors of a forecaster fitted on every
sweep run.

    python -m bench.forecast_validity SWEEP_DIR [SWEEP_DIR ...] [--controls DIR ...] [--moved DIR ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from analysis.forecast import fit_sweep_histories, history_of, prior_law_of
from metrics.dynamics.forecast import (
    LEVEL,
    LOSS,
    WAYS,
    Z_LEVEL,
    Forecast,
    History,
    features_along,
    forecast_at,
    forecasts_along,
    no_induction_circuit,
    past_midpoint,
    rule_forecast,
)
from metrics.dynamics.phase_change import SMOOTHING_WINDOW
from models.interventions import plan_of, silenced_throughout
from reports.sweep_report import SEED_KEYS, Job, read_jobs

ALARM_P = 0.8


def cell_of(history: History) -> tuple:
    return tuple(sorted((k, v) for k, v in history.settings.items() if k not in SEED_KEYS))


def seed_of(history: History) -> str:
    return next((history.settings[k] for k in SEED_KEYS if k in history.settings), "0")


def constant(history: History, midpoint: float, low: float, high: float) -> list[Forecast]:
    """The same forecast at every snapshot (a baseline that reads nothing of the run)."""
    return [Forecast(float(t), midpoint, low, high, float(midpoint <= history.max_steps)) for t in history.steps[2:]]


def forecasters(train: list[tuple[Job, History, np.ndarray]]) -> dict[str, Callable]:
    """Each forecaster, fitted on ``train``, as a function of a run (its history and features) to its forecasts."""
    jobs = [j for j, _, _ in train]
    histories = [h for _, h, _ in train]
    along = [a for _, _, a in train]
    fitted = fit_sweep_histories(jobs, histories, law=True, along=along)
    bare = fit_sweep_histories(jobs, histories, law=False, along=along)
    law = prior_law_of(jobs, histories)
    midpoints = np.array([h.midpoint for h in histories if h.midpoint is not None])
    median = float(np.median(midpoints))
    low, high = np.quantile(midpoints, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])

    def by_law(h: History, a: np.ndarray) -> list[Forecast]:
        m = law.predict(h.settings) if law else None
        if m is None:
            return []
        spread = math.exp(Z_LEVEL * law.sigma)
        return constant(h, m, m / spread, m * spread)

    return {
        "rule": lambda h, a: forecasts_along(h, None),
        "fitted + law": lambda h, a: forecasts_along(h, fitted, along=a),
        "fitted": lambda h, a: forecasts_along(h, bare, along=a),
        "law alone": by_law,
        "sweep median": lambda h, a: constant(h, median, float(low), float(high)),
    }


def judged(history: History, forecasts: list[Forecast]) -> list[tuple[float, bool] | None]:
    """At each of :data:`WAYS`: (relative error, covered), or None where no forecast had been made."""
    out = []
    for way in WAYS:
        f = forecast_at(forecasts, way * history.midpoint)
        if f is None:
            out.append(None)
        else:
            error = f.midpoint / history.midpoint - 1 if math.isfinite(f.midpoint) else math.inf
            out.append((error, f.low <= history.midpoint <= f.high))
    return out


def summary(results: list[list[tuple[float, bool] | None]]) -> str:
    """Median |relative error| at each way (and how many runs had a forecast), and the pooled coverage."""
    cells, covered = [], []
    for k in range(len(WAYS)):
        made = [r[k] for r in results if r[k] is not None]
        errors = [abs(e) for e, _ in made]
        covered += [c for _, c in made]
        cells.append(
            f"{np.median(errors):6.1%} ({len(made)}/{len(results)})" if errors else f"{'-':>6} (0/{len(results)})"
        )
    coverage = f"{np.mean(covered):5.0%}" if covered else "  -"
    return "  ".join(cells) + f"   {coverage}"


def held_out(runs, split: Callable[[History], object]) -> dict[str, list]:
    """Each group of ``split`` left out in turn: every forecaster's judgements of its runs."""
    results: dict[str, list] = {}
    for group in sorted({split(h) for _, h, _ in runs}, key=str):
        train = [r for r in runs if split(r[1]) != group]
        test = [r for r in runs if split(r[1]) == group and r[1].midpoint is not None]
        if not test or not any(h.midpoint is not None for _, h, _ in train):
            continue
        for name, forecast in forecasters(train).items():
            results.setdefault(name, []).extend(judged(h, forecast(h, a)) for _, h, a in test)
    return results


def load(paths: list[Path]) -> list[tuple[Job, History, np.ndarray]]:
    """Every finished run under ``paths`` with its history and features; a run whose settings and seed
    repeat one already loaded (the same job in two sweeps) once."""
    runs, seen = [], set()
    for path in paths:
        for job in read_jobs([path]):
            if (history := history_of(job)) is not None and (cell_of(history), seed_of(history)) not in seen:
                seen.add((cell_of(history), seed_of(history)))
                runs.append((job, history, features_along(history)))
    return runs


def print_table(title: str, results: dict[str, list]) -> None:
    ways = "  ".join(f"{f'{w:.0%} of the way':>13}" for w in WAYS)
    print(f"\n{title}\n{'forecaster':<14}{ways}   {LEVEL:.0%} interval covers")
    for name, rows in results.items():
        print(f"{name:<14}{summary(rows)}")


def why_no_forecast(job: Job) -> str | None:
    """Why a run makes no forecast at all, as ``runtime.build`` decides: its model cannot form an
    induction circuit (:func:`metrics.dynamics.forecast.no_induction_circuit`)."""
    model = job.config.get("model") or {}
    n_layers, n_heads = int(model.get("n_layers", 2)), int(model.get("n_heads", 2))
    return no_induction_circuit(
        n_layers, n_heads, silenced_throughout(plan_of(job.config.get("intervention")), n_heads)
    )


def false_alarms(runs, fitted_on) -> None:
    """Runs without a cliff: how many get a forecast midpoint before ``max_steps`` with ``p_before_end`` ≥ 0.8,
    as the run makes them (none where its model cannot form an induction circuit) and, beside it, what the
    forecaster alone would say on every run."""
    print(f"\nfalse alarms (a forecast midpoint before max_steps with p_before_end >= {ALARM_P}), runs without a cliff")
    gated = [why for job, _, _ in runs if (why := why_no_forecast(job))]
    print(f"no forecast made on {len(gated)} of {len(runs)} runs: their model cannot form an induction circuit")
    fitted = forecasters(fitted_on)
    for name in ("rule", "fitted + law", "fitted"):
        alarms, snapshots, total, ungated = 0, 0, 0, 0
        for job, h, a in runs:
            made = [f for f in fitted[name](h, a) if not math.isnan(f.midpoint)]
            hits = [f for f in made if f.midpoint < h.max_steps and f.p_before_end >= ALARM_P]
            ungated += bool(hits)
            if why_no_forecast(job):
                continue
            alarms += bool(hits)
            snapshots += len(hits)
            total += len(made)
        print(
            f"{name:<14}{alarms} of {len(runs)} runs ({snapshots} of {total} forecasts); the forecaster alone: {ungated}"
        )


def forecast_seconds(history: History, repeats: int = 5) -> tuple[float, int]:
    """The callback's work over a run's snapshots (the midpoint check at each, the rule's forecast until
    the loss has fallen half its first level), best of ``repeats``; and how many forecasts it made."""
    best, made = math.inf, 0
    for _ in range(repeats):
        start, made = time.perf_counter(), 0
        for i in range(2, len(history.steps)):
            steps, series = history.upto(i)
            if past_midpoint(series[LOSS], SMOOTHING_WINDOW):
                break
            rule_forecast(steps, series[LOSS], history.max_steps)
            made += 1
        best = min(best, time.perf_counter() - start)
    return best, made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.forecast_validity", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", type=Path, nargs="+")
    parser.add_argument("--controls", type=Path, nargs="*", default=[], help="sweeps of runs without a cliff")
    parser.add_argument(
        "--moved", type=Path, nargs="*", default=[], help="sweeps whose phase change an intervention moved"
    )
    parser.add_argument("--cost", type=Path, default=None, help="a run whose forecasts to time (the default run)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    runs = load(args.sweeps)
    with_midpoint = sum(h.midpoint is not None for _, h, _ in runs)
    print(f"{len(runs)} runs ({with_midpoint} with a phase change) from {', '.join(map(str, args.sweeps))}")
    print_table("held-out seeds (each seed left out in turn)", held_out(runs, seed_of))
    print_table("held-out cells (each cell left out in turn, all its seeds)", held_out(runs, cell_of))
    if args.moved:
        moved = [r for r in load(args.moved) if r[1].midpoint is not None]
        results = {name: [judged(h, f(h, a)) for _, h, a in moved] for name, f in forecasters(runs).items()}
        print_table(f"moved by an intervention ({len(moved)} runs; fitted on every sweep run)", results)
    if args.controls:
        false_alarms(load(args.controls), runs)
    if args.cost:
        [job] = read_jobs([args.cost])
        seconds, made = forecast_seconds(history_of(job))
        print(f"\nthe forecast's cost over {args.cost}: {seconds * 1e3:.1f} ms for {made} forecasts (best of 5)")
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
