"""How right the phase-change detector (:func:`metrics.dynamics.phase_change.find_phase_change`) is, on series
whose truth is known, and how little what comes after a cliff moves it:

- **planted cliffs**: a logistic fall of the repeated-token loss (5.5 -> 0.1 nats, midpoint and width drawn)
  on Gaussian noise, logged every 10 steps, the run going on long after it (with the tail) or stopping
  one to five snapshots after its 90 % point (without): how often it is found, and the error of its onset,
  midpoint and end against the logistic's own 10 / 50 / 90 % points;
- **no cliff**: flat noise, a slow exponential decay from the first step, a straight decline: how often a
  phase change is reported where there is none;
- **truncation** (``RUN_DIR ...``): each run's repeated-token loss cut after every snapshot from its phase
  change's end on; the largest move of onset, midpoint and end from the whole run's, in snapshots.

    python -m bench.phase_change_validity [--draws 100] [--seed 0] [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

from metrics.dynamics.phase_change import SMALLEST_PHASE_CHANGE, NoPhaseChange, PhaseChange, find_phase_change
from records.layout import CSV_RELATIVE_PATH
from reports.run_report import read_series

EVERY = 10  # steps between snapshots, as the tracker's default
HIGH, LOW = 5.5, 0.1  # nats: the default run's repeated-token loss before and after its cliff
MIN_CHANGE = SMALLEST_PHASE_CHANGE["loss/repeated"]
SPREAD = math.log(9)  # a logistic's 10 % and 90 % points are its midpoint -/+ width * ln 9


def logistic(steps: np.ndarray, midpoint: float, width: float) -> np.ndarray:
    return LOW + (HIGH - LOW) / (1 + np.exp((steps - midpoint) / width))


def detect(steps: np.ndarray, values: np.ndarray) -> PhaseChange | NoPhaseChange:
    return find_phase_change(torch.from_numpy(steps), torch.from_numpy(values), min_change=MIN_CHANGE)


def planted(rng: np.random.Generator, noise: float, tail: bool) -> tuple[np.ndarray, np.ndarray, tuple]:
    """One planted cliff: (steps, values, (true onset, midpoint, end))."""
    midpoint, width = rng.uniform(300, 1200), rng.uniform(10, 40)
    end = midpoint + width * SPREAD
    last = end + rng.uniform(300, 1000) if tail else end + EVERY * rng.integers(1, 6)
    steps = np.arange(0, last + 1, EVERY, dtype=np.float64)
    values = logistic(steps, midpoint, width) + rng.normal(0, noise, len(steps))
    return steps, values, (midpoint - width * SPREAD, midpoint, end)


def no_cliff(rng: np.random.Generator, kind: str, noise: float) -> tuple[np.ndarray, np.ndarray]:
    steps = np.arange(0, rng.uniform(600, 2000), EVERY, dtype=np.float64)
    if kind == "flat noise":
        clean = np.full(len(steps), HIGH)
    elif kind == "exponential decay":
        clean = LOW + (HIGH - LOW) * np.exp(-steps / (steps[-1] * rng.uniform(0.15, 0.5)))
    else:  # a straight decline
        clean = HIGH - (HIGH - LOW) * steps / steps[-1]
    return steps, clean + rng.normal(0, noise, len(steps))


def planted_table(draws: int, seed: int) -> list[dict]:
    rows = []
    for noise in (0.05, 0.2):
        for tail in (True, False):
            rng = np.random.default_rng(seed)
            found, errors = 0, {"onset": [], "midpoint": [], "end": []}
            ends_beyond = 0
            for _ in range(draws):
                steps, values, truth = planted(rng, noise, tail)
                change = detect(steps, values)
                if not isinstance(change, PhaseChange):
                    continue
                found += 1
                for name, got, want in zip(errors, (change.onset_step, change.midpoint_step, change.end_step), truth):
                    if got is None:
                        ends_beyond += 1
                    else:
                        errors[name].append(abs(got - want))
            row = {"noise (nats)": noise, "tail": "with" if tail else "without", "found": f"{found}/{draws}"}
            for name, values in errors.items():
                e = np.array(values)
                row[f"{name} |error| median / 90 % (steps)"] = (
                    f"{np.median(e):.1f} / {np.percentile(e, 90):.1f}" if len(e) else "-"
                )
            row["end beyond the run"] = ends_beyond
            rows.append(row)
    return rows


def null_table(draws: int, seed: int) -> list[dict]:
    rows = []
    for kind in ("flat noise", "exponential decay", "straight decline"):
        for noise in (0.05, 0.2):
            rng = np.random.default_rng(seed)
            reported = sum(isinstance(detect(*no_cliff(rng, kind, noise)), PhaseChange) for _ in range(draws))
            rows.append({"series": kind, "noise (nats)": noise, "phase change reported": f"{reported}/{draws}"})
    return rows


def truncation_table(run_dir: Path) -> dict:
    steps, values = read_series(run_dir / CSV_RELATIVE_PATH)["loss/repeated"]
    whole = detect(steps, values)
    if not isinstance(whole, PhaseChange) or not whole.finished:
        return {"run": str(run_dir), "whole run": getattr(whole, "reason", "its end is beyond the run")}
    cuts = [k for k in range(len(steps)) if steps[k] > whole.end_step]
    moves = {"onset": [], "midpoint": [], "end": []}
    none, beyond = [], []
    for k in cuts:
        cut = detect(steps[: k + 1], values[: k + 1])
        if not isinstance(cut, PhaseChange):
            none.append(int(steps[k]))
            continue
        moves["onset"].append(abs(cut.onset_step - whole.onset_step) / EVERY)
        moves["midpoint"].append(abs(cut.midpoint_step - whole.midpoint_step) / EVERY)
        if cut.finished:
            moves["end"].append(abs(cut.end_step - whole.end_step) / EVERY)
        else:
            beyond.append(int(steps[k]))
    largest = lambda name: f"{max(moves[name]):.2f}" if moves[name] else "-"
    within = lambda name: f"{sum(m <= 1 for m in moves[name])}/{len(moves[name])}"
    return {
        "run": str(run_dir),
        "whole run: onset / midpoint / end": f"{whole.onset_step:.1f} / {whole.midpoint_step:.1f} / {whole.end_step:.1f}",
        "cuts past its end": f"{len(cuts)} (steps {int(steps[cuts[0]])}-{int(steps[cuts[-1]])})" if cuts else "0",
        "none yet (still falling fast)": ", ".join(map(str, none)) or "-",
        "onset: largest move / within one snapshot": f"{largest('onset')} / {within('onset')}",
        "midpoint: largest move / within one snapshot": f"{largest('midpoint')} / {within('midpoint')}",
        "end: beyond the run at": ", ".join(map(str, beyond)) or "-",
        "end, where reported: largest move / within one snapshot": f"{largest('end')} / {within('end')}",
    }


def markdown(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("runs", nargs="*", type=Path, help="run directories to cut after their phase change's end")
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for run in args.runs:
        if not (run / CSV_RELATIVE_PATH).is_file():
            print(f"error: {run} holds no {CSV_RELATIVE_PATH}", file=sys.stderr)
            return 2
    print(f"planted cliffs, {args.draws} draws each (midpoint U(300, 1200), width U(10, 40) steps):\n")
    print(markdown(planted_table(args.draws, args.seed)))
    print(f"\nno cliff, {args.draws} draws each:\n")
    print(markdown(null_table(args.draws, args.seed)))
    if args.runs:
        print("\ntruncation: each run cut after every snapshot past its phase change's end:\n")
        rows = [truncation_table(run) for run in args.runs]
        found = [row for row in rows if "whole run" not in row]
        print(markdown(found) if found else "")
        for row in rows:
            if "whole run" in row:
                print(f"{row['run']}: no phase change in the whole run ({row['whole run']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
