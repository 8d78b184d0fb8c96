"""When each measure rises, against the ground truth: the run's causal pair through its phase change.

    python -m reports.rise RUN_DIR                                 # one run
    python -m reports.rise multirun/DATE/TIME                      # every job of a sweep, then mean ± sd
    python -m reports.rise multirun/DATE/TIME --analysis NAME      # what a re-score measured (analysis.rescore)

aslvrstn 2022 ("Composition Measures in Transformers") wanted a composition score that stays near
zero until the induction head forms and then rises to its final value. Whether a measure does that
is a question about time, and the K-only path ablation (docs/measures.md, "Ground truth: ablation")
answers it for the model itself: how much the writer's write into the reader's keys moves the
reader's pattern (``--effect pattern_change``, the default: what K composition acts on) or the
repeated-token loss (``loss_change``). So every series here is the run's **causal pair** (the pair
whose ablation hurts the loss most at the last ablation step, the validity table's ground-truth
pair; not always the circuit pair the tracker names from the head scores, docs/measures.md), read
from the run's tensor store (``tensors/``, every pair at every snapshot), and put on one scale: its
**rise** ``r(t) = (v(t) − v(t₀)) / (v_final − v(t₀))``, 0 at the first step and 1 at its final level
(the mean over the last quarter of its steps, well after the phase change in the default run). The
ablation's own rise is the reference row (``ablation``).

Columns, per measure: ``before onset`` the largest raw value at the steps up to the loss's onset and
``after end`` the smallest from its end on (the raw readings docs/share_results.md holds the
data-aware share to: ≤ 0.1 before the onset, ≥ 0.5 after the end); ``paced@onset`` the raw value the
measure would read at the onset had it risen exactly as the truth does (its first value plus the
truth's rise at the onset times its own way to its final level: what "before onset" can be for a
measure that follows the ground truth); the rise at the onset, the midpoint and the end (linear
between snapshots); ``half − truth``: the first step the rise reaches 0.5 minus the ablation's
(negative: the measure rises first); ``gap``: the mean ``|r_measure − r_ablation|`` at the
ablation's steps from ``onset − w`` to ``end + w``, ``w = end − onset``. Several runs: each run's
table, then the mean ± sd over the runs. The phase change is the run's (its ``summary.json``; with
``--analysis``, the one the re-score found in its own series).
A training run measures the ablation every 100 steps by default, so its truth is coarse through the
phase change; ``python -m analysis.rescore RUN_DIR --name NAME`` measures it at every saved step
(``trajectory/``, densest there), and ``--analysis NAME`` reads that.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from records.layout import ANALYSIS_DIR, SUMMARY_NAME, TENSORS_DIR, job_dirs, run_label
from records.tensor_store import read_tensor_store

EFFECTS = ("pattern_change", "loss_change")
TRUTH = "ablation"
"""The reference row's name."""
COLUMNS = (
    "before_onset",
    "after_end",
    "paced_at_onset",
    "rise_at_onset",
    "rise_at_midpoint",
    "rise_at_end",
    "half_minus_truth",
    "gap",
)
HEADERS = ("before onset", "after end", "paced@onset", "rise@onset", "rise@mid", "rise@end", "half - truth", "gap")
FINAL_SHARE = 0.25
"""The last quarter of a series' steps sets its final level."""


def final_level(steps: np.ndarray, values: np.ndarray) -> float:
    """The mean of ``values`` over the last ``FINAL_SHARE`` of the steps."""
    return float(values[steps >= steps[0] + (1 - FINAL_SHARE) * (steps[-1] - steps[0])].astype(float).mean())


def rise(steps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values [n]`` at ``steps [n]`` rescaled to 0 at the first step and 1 at the final level
    (:func:`final_level`); NaN throughout when the two are equal (to float32 rounding: the store's
    precision)."""
    values = values.astype(float)
    final = final_level(steps, values)
    if np.isclose(final, values[0], rtol=1e-5, atol=1e-12):
        return np.full_like(values, math.nan)
    return (values - values[0]) / (final - values[0])


def at(steps: np.ndarray, values: np.ndarray, step: float) -> float:
    """``values`` at ``step``, linear between the logged steps (NaN outside them)."""
    if not steps[0] <= step <= steps[-1]:
        return math.nan
    return float(np.interp(step, steps, values))


def first_reaching(steps: np.ndarray, values: np.ndarray, level: float) -> float:
    """The first step at which ``values`` reach ``level``, linear between the snapshots (NaN if never)."""
    above = np.flatnonzero(values >= level)
    if not len(above):
        return math.nan
    i = int(above[0])
    if i == 0:
        return float(steps[0])
    s0, s1, v0, v1 = steps[i - 1], steps[i], values[i - 1], values[i]
    return float(s0 + (level - v0) / (v1 - v0) * (s1 - s0))


def rise_row(
    steps: np.ndarray, values: np.ndarray, truth: tuple[np.ndarray, np.ndarray], change: dict[str, float]
) -> dict[str, float]:
    """One measure's columns (``COLUMNS``) for one pair's series, against the truth's ``(steps, rise)``
    and the phase change ``{"onset", "midpoint", "end"}`` (steps)."""
    onset, end = change["onset"], change["end"]
    r = rise(steps, values)
    truth_steps, truth_rise = truth
    before, after = values[steps <= onset], values[steps >= end]
    width = end - onset
    window = (truth_steps >= onset - width) & (truth_steps <= end + width)
    measured = np.interp(truth_steps[window], steps, r)
    return {
        "before_onset": float(before.max()) if len(before) else math.nan,
        "after_end": float(after.min()) if len(after) else math.nan,
        "paced_at_onset": float(
            values[0] + at(truth_steps, truth_rise, onset) * (final_level(steps, values) - values[0])
        ),
        "rise_at_onset": at(steps, r, onset),
        "rise_at_midpoint": at(steps, r, change["midpoint"]),
        "rise_at_end": at(steps, r, end),
        "half_minus_truth": first_reaching(steps, r, 0.5) - first_reaching(truth_steps, truth_rise, 0.5),
        "gap": float(np.abs(measured - truth_rise[window]).mean()) if window.any() else math.nan,
    }


def causal_pair(effects: np.ndarray) -> tuple[int, int, int, int]:
    """``effects [L, H, L, H]`` at the last ablation step: the pair that moves most (NaN pairs skipped)."""
    flat = np.where(np.isnan(effects), -np.inf, effects)
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(flat)), flat.shape))


def rise_table(source: Path, effect: str = "pattern_change", kind: str = "K") -> tuple[str, dict[str, dict]]:
    """``(pair label, {measure: columns})`` of one run (or analysis) directory, the ablation first."""
    summary = json.loads((source / SUMMARY_NAME).read_text())
    change = {k: summary.get(f"phase_change/loss_{k}_step", math.nan) for k in ("onset", "midpoint", "end")}
    if any(math.isnan(v) for v in change.values()):
        raise ValueError(f"{source / SUMMARY_NAME} has no loss phase change: nothing to read a rise against")
    store = read_tensor_store(source / TENSORS_DIR)
    if f"ablation/{effect}" not in store:
        raise ValueError(f"{source / TENSORS_DIR} has no ablation/{effect} (was the ablation on, with tracker.store?)")
    truth_steps, truth_values = store[f"ablation/{effect}"]
    pair = causal_pair(store["ablation/loss_change"][1][-1] if "ablation/loss_change" in store else truth_values[-1])
    index = (slice(None), *pair)
    truth = (truth_steps, rise(truth_steps, truth_values[index]))
    rows = {TRUTH: rise_row(truth_steps, truth_values[index], truth, change)}
    for name in sorted(store):
        if name.startswith(f"comp/{kind}/"):
            steps, values = store[name]
            rows[name.removeprefix(f"comp/{kind}/")] = rise_row(steps, values[index], truth, change)
    label = "L{}H{}->L{}H{}".format(*pair)
    when = f"onset {change['onset']:.0f}, midpoint {change['midpoint']:.0f}, end {change['end']:.0f}"
    return f"{label}, {when}; the ablation at {len(truth_steps)} steps", rows


STEP_COLUMNS = ("half_minus_truth",)
"""Columns in steps (printed whole); the others are values and rises."""


def format_rows(rows: dict[str, dict]) -> str:
    """A fixed-width table: a measure a line, ``COLUMNS`` (a cell is a value or ``mean ± sd``)."""
    lines = [f"  {'measure':<16}" + "".join(f"{h:>15}" for h in HEADERS)]
    for measure, row in rows.items():
        lines.append(f"  {measure:<16}" + "".join(f"{cell(row[c], c):>15}" for c in COLUMNS))
    return "\n".join(lines)


def cell(value: float | str, column: str) -> str:
    if isinstance(value, str):
        return value
    return "—" if math.isnan(value) else f"{value:.0f}" if column in STEP_COLUMNS else f"{value:.2f}"


def spread(tables: list[dict[str, dict]]) -> dict[str, dict]:
    """``mean ± sd`` over runs of every column of the measures every run has."""
    measures = [m for m in tables[0] if all(m in t for t in tables)]
    out = {}
    for measure in measures:
        out[measure] = {}
        for column in COLUMNS:
            values = np.array([t[measure][column] for t in tables], dtype=float)
            values = values[~np.isnan(values)]
            sd = values.std(ddof=1) if len(values) > 1 else 0.0
            text = "—" if not len(values) else f"{cell(values.mean(), column)} ± {cell(sd, column)}"
            out[measure][column] = text + ("" if len(values) == len(tables) else f" ({len(values)})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", type=Path, nargs="+", help="run directories or sweep directories")
    parser.add_argument("--analysis", default=None, help=f"read RUN_DIR/{ANALYSIS_DIR}/NAME (a re-score) instead")
    parser.add_argument("--effect", choices=EFFECTS, default="pattern_change", help="the ablation's effect (truth)")
    parser.add_argument("--kind", choices=("Q", "K", "V"), default="K", help="the composition kind read")
    args = parser.parse_args(argv)
    runs = job_dirs(args.paths)
    if not runs:
        print(f"error: no run directory in {', '.join(map(str, args.paths))}", file=sys.stderr)
        return 1
    sources = [run / ANALYSIS_DIR / args.analysis if args.analysis else run for run in runs]
    missing = [str(s) for s in sources if not (s / SUMMARY_NAME).is_file() or not (s / TENSORS_DIR).is_dir()]
    if missing:
        print(f"error: no {SUMMARY_NAME} and {TENSORS_DIR}/ in {', '.join(missing)}", file=sys.stderr)
        return 1
    tables = []
    for run, source in zip(runs, sources):
        try:
            label, rows = rise_table(source, args.effect, args.kind)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(f"{run_label(run)} ({label}); the truth: the ablation's {args.effect}")
        print(format_rows(rows))
        tables.append(rows)
    if len(tables) > 1:
        print(f"over {len(tables)} runs (mean ± sd; a count where a value is missing in some runs)")
        print(format_rows(spread(tables)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
