"""Every head pair's K-composition over training, raw (no baseline subtracted), one panel per
measure, above the repeated-token and training losses: aslvrstn 2022's plot, for every measure.

Drawn from a run's tensor store and CSV log (so any run directory, finished or not):

    python -m reports.pair_curves outputs/2026-11-23/10-00-00 [--out FILE] [--max-step N]

Writes ``RUN_DIR/pair_curves.png`` by default and prints, per pair, the Frobenius score at step 0,
its largest value in the first 100 steps and the step of it, and its last value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from records.layout import CSV_RELATIVE_PATH, PAIR_CURVES_FIGURE, TENSORS_DIR, run_label
from records.outputs import WRITTEN_BY, foreign_out
from records.tensor_store import read_tensor_store
from reports.plots import mark_interventions, plt
from reports.run_report import intervention_windows, read_series

FIGURE_MARK = f"{WRITTEN_BY} pair_curves"
"""The figure's PNG Software field: an --out holding it is this command's figure."""


def pair_series(run_dir: Path) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list[tuple[int, int, int, int]]]:
    """``{measure: (steps [n], values [n, pairs])}`` of every measure's K-composition in the store,
    and the pairs ``(l1, h1, l2, h2)`` (reader's layer later), in column order."""
    store = read_tensor_store(run_dir / TENSORS_DIR)
    measures = sorted(name.removeprefix("comp/K/") for name in store if name.startswith("comp/K/"))
    if not measures:
        raise FileNotFoundError(f"no comp/K/ tensors in {run_dir / TENSORS_DIR} (was it run with tracker.store=true?)")
    L, H = store[f"comp/K/{measures[0]}"][1].shape[1:3]
    pairs = [(l1, h1, l2, h2) for l1 in range(L) for h1 in range(H) for l2 in range(l1 + 1, L) for h2 in range(H)]
    index = tuple(np.array(axis) for axis in zip(*pairs))
    return {m: (store[f"comp/K/{m}"][0], store[f"comp/K/{m}"][1][(slice(None), *index)]) for m in measures}, pairs


def draw(run_dir: Path, out: Path, max_step: int | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    by_measure, pairs = pair_series(run_dir)
    series = read_series(run_dir / CSV_RELATIVE_PATH) if (run_dir / CSV_RELATIVE_PATH).is_file() else {}
    columns = 4
    rows = -(-len(by_measure) // columns) + 1
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    labels = [f"L{a}H{b}->L{c}H{d}" for a, b, c, d in pairs]
    for ax, (measure, (steps, values)) in zip(axes[:-1].flat, by_measure.items()):
        keep = steps <= max_step if max_step else slice(None)
        for column, label in enumerate(labels):
            ax.plot(steps[keep], values[keep, column], lw=1.1, label=label)
        ax.set_title(f"K-composition, {measure} (raw)", fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes[:-1].flat)[len(by_measure) :]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=6)
    loss_ax = axes[-1, 0]
    for key, label in (("loss/repeated", "loss on repeated tokens (probe)"), ("train/loss", "training loss")):
        if key in series:
            steps, values = series[key]
            keep = steps <= max_step if max_step else slice(None)
            loss_ax.plot(steps[keep], values[keep], label=label, lw=1.1)
    loss_ax.set_xlabel("step")
    loss_ax.legend(fontsize=7)
    loss_ax.set_title("losses", fontsize=9)
    for ax in axes[-1, 1:]:
        ax.axis("off")
    windows = intervention_windows(run_dir)
    last = max_step or max((float(steps[-1]) for steps, _ in by_measure.values() if len(steps)), default=0.0)
    for ax in axes.flat:
        if ax.axison:
            mark_interventions(ax, windows, last)
    fig.suptitle(f"{run_label(run_dir)}: every L<->L' pair's K-composition over training", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={"Software": FIGURE_MARK})
    plt.close(fig)
    return by_measure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help=f"the figure (default RUN_DIR/{PAIR_CURVES_FIGURE})")
    parser.add_argument("--max-step", type=int, default=None, help="draw steps up to this one")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / PAIR_CURVES_FIGURE
    if args.out is not None and (why := foreign_out(args.out, FIGURE_MARK)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        by_measure = draw(args.run_dir, out, args.max_step)
    except (FileNotFoundError, ValueError) as error:  # ValueError: a damaged file (records.layout.DamagedFile)
        print(f"error: {error}", file=sys.stderr)
        return 1
    _, pairs = pair_series(args.run_dir)
    if "frobenius" in by_measure:
        steps, values = by_measure["frobenius"]
        early = steps <= 100
        print("pair              frobenius K: step 0   max in steps 0-100 (step)   last")
        for column, (a, b, c, d) in enumerate(pairs):
            top = int(np.argmax(values[early, column]))
            print(
                f"L{a}H{b}->L{c}H{d}      {values[0, column]:8.3f}     {values[early, column][top]:8.3f} ({int(steps[early][top]):4d})"
                f"          {values[-1, column]:8.3f}"
            )
    print(f"figure: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
