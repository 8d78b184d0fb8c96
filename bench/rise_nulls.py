"""How well ``reports.rise`` reads a lead or lag whose truth is known, at the noise and step grids of real runs.

    python -m bench.rise_nulls                       # 500 draws of each case
    python -m bench.rise_nulls --draws 2000 --seed 1

Each draw is a phase change like the default run's: the truth (the ablation's effect) a logistic
rise centred at a step drawn from 350-450 (anywhere between a grid's steps) that takes ~110 steps
from 10 % to 90 %, to 0.4, with Gaussian noise of 2 % of its final level at each step; a measure
the same rise shifted by a known number of steps, to 0.9, with noise of 1 % (the step-to-step
spreads of the ablation's pattern effect and of the share on seeds 0-3 are 1.1-2.2 % and
0.5-0.9 %). The truth is read on two grids: a re-score's saved
steps (log-spaced to 149, every 10 from 180 to 520, every 100 after) and a training run's ablation
(every 100 steps); the measure at the re-score's steps or every 10 steps. The phase change is the
truth's own 10 %-90 % crossing, as ``summary.json`` gives a run's onset and end.

Prints, per case: the error of the half-rise step against the true shift (median, sd, and how often
within 10 steps), and the gap (median and 95th percentile) a measure with no shift reads from the
noise alone: the floor under the gaps ``reports.rise`` reports.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from reports.rise import rise, rise_row

CENTRE, WIDTH = 400.0, 25.0
TRUTH_FINAL, MEASURE_FINAL = 0.4, 0.9
TRUTH_NOISE, MEASURE_NOISE = 0.02, 0.01
"""Noise as a share of the final level."""
SHIFTS = (0, -50, 50)
LAST_STEP = 1500


def rescore_grid() -> np.ndarray:
    """The saved steps of a default run: log-spaced to 149, every 10 through the phase change, then every 100."""
    early = np.unique(np.round(np.geomspace(1, 149, 14)).astype(int))
    return np.unique(np.concatenate([[0], early, np.arange(180, 521, 10), np.arange(600, LAST_STEP + 1, 100)]))


def logistic(steps: np.ndarray, centre: float) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(steps - centre) / WIDTH))


def draw(rng, steps: np.ndarray, centre: float, final: float, noise: float) -> np.ndarray:
    return final * logistic(steps, centre) + rng.normal(0.0, noise * final, len(steps))


def case(rng, draws: int, truth_steps: np.ndarray, measure_steps: np.ndarray, shift: float) -> dict[str, float]:
    """The half-rise error (read − true shift) and the gap over ``draws`` draws."""
    spread = WIDTH * np.log(9.0)  # the logistic's 10 %-90 % half-width
    errors, gaps = [], []
    for _ in range(draws):
        centre = CENTRE + rng.uniform(-50.0, 50.0)
        change = {"onset": centre - spread, "midpoint": centre, "end": centre + spread}
        truth = draw(rng, truth_steps, centre, TRUTH_FINAL, TRUTH_NOISE)
        measure = draw(rng, measure_steps, centre + shift, MEASURE_FINAL, MEASURE_NOISE)
        row = rise_row(measure_steps, measure, (truth_steps, rise(truth_steps, truth)), change)
        errors.append(row["half_minus_truth"] - shift)
        gaps.append(row["gap"])
    errors, gaps = np.array(errors), np.array(gaps)
    return {
        "median error": float(np.median(errors)),
        "sd": float(errors.std(ddof=1)),
        "within 10 steps": float(np.mean(np.abs(errors) <= 10)),
        "gap median": float(np.median(gaps)),
        "gap 95th": float(np.percentile(gaps, 95)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    grids = {
        "re-score (truth and measure at the saved steps)": (rescore_grid(), rescore_grid()),
        "training run (truth every 100 steps, measure every 10)": (
            np.arange(0, LAST_STEP + 1, 100),
            np.arange(0, LAST_STEP + 1, 10),
        ),
    }
    print(
        f"{args.draws} draws a case; truth: logistic at {CENTRE:.0f} ± 50, width {WIDTH:.0f}, noise {TRUTH_NOISE:.0%}"
        f" of its final; measure: noise {MEASURE_NOISE:.0%}"
    )
    header = f"  {'true shift':>10} {'half-rise error: median':>24} {'sd':>6} {'within 10':>10} {'gap: median':>12} {'95th':>6}"
    for name, (truth_steps, measure_steps) in grids.items():
        print(name)
        print(header)
        for shift in SHIFTS:
            r = case(rng, args.draws, truth_steps, measure_steps, shift)
            print(
                f"  {shift:>+10d} {r['median error']:>24.1f} {r['sd']:>6.1f} {r['within 10 steps']:>10.0%}"
                f" {r['gap median']:>12.3f} {r['gap 95th']:>6.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
