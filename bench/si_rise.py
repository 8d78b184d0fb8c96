"""When a chain run's statistical-induction head rises, against its unigram → bigram strategy switch,
and whether that rise is real (docs/strategy_results.md, "Statistical induction against the bigram
switch").

The *rise*: the first snapshot from which the best later-layer head's statistical-induction excess
(its score less the random-attention null's mean, :mod:`metrics.heads.behaviour`) stays ≥ ``LEVEL``
for ``PERSIST`` snapshots. Checked here before it is read: on noise (each run's own first snapshots,
resampled over the run's length: how often it fires), on planted rises (a logistic rise to the run's
final excess at a known step, the same noise added: how far from the true crossing it lands), at other
levels (does the order against the switch hold), and on runs where no head can do statistical
induction (``--null``: layer 0 ablated from step 0, so no later head sees the previous token).

    python -m bench.si_rise RUN_DIR [RUN_DIR ...] [--null RUN_DIR ...] [--draws 1000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from metrics.heads.behaviour import BUILT_IN_BEHAVIOURS
from records.layout import SUMMARY_NAME, TENSORS_DIR
from records.tensor_store import read_tensor_store, tensor_labels

LEVEL, PERSIST = 0.1, 3
LEVELS = (0.05, 0.1, 0.15, 0.2)
PLATEAU = 20  # the first snapshots, before anything forms: the noise the rise must clear


def rise(steps: np.ndarray, excess: np.ndarray, level: float = LEVEL, persist: int = PERSIST) -> int | None:
    """The first step from which ``excess`` stays ≥ ``level`` for ``persist`` snapshots (None: never)."""
    above = excess >= level
    for i in range(len(above) - persist + 1):
        if above[i : i + persist].all():
            return int(steps[i])
    return None


def excess_curve(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, excess)``: the best later-layer head's statistical-induction score less the null's mean."""
    names = [f"{prefix}behaviour/{part}" for prefix in ("heads/", "") for part in ("scores", "null_mean")]
    stored = read_tensor_store(run_dir / TENSORS_DIR, names)
    prefix = "heads/" if "heads/behaviour/scores" in stored else ""
    steps, scores = stored[f"{prefix}behaviour/scores"]  # (n, L, H, behaviours)
    behaviours = tensor_labels(run_dir / TENSORS_DIR).get(f"{prefix}behaviour/scores", BUILT_IN_BEHAVIOURS)
    column = list(behaviours).index("statistical_induction")
    null = stored[f"{prefix}behaviour/null_mean"][1][-1]
    return steps, scores[:, 1:, :, column].max(axis=(1, 2)) - null[column]


def bigram_switch(run_dir: Path) -> tuple[float, float, float] | None:
    """The run's switch to the bigram strategy: ``(step, low, high)`` from its summary."""
    summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    for i in range(1, int(summary.get("strategies/switches", 0)) + 1):
        key = f"strategies/switch/{i}"
        if str(summary[key]).endswith("bigram"):
            return summary[f"{key}/step"], summary.get(f"{key}/low", np.nan), summary.get(f"{key}/high", np.nan)
    return None


def false_rises(excess: np.ndarray, draws: int, rng: np.random.Generator) -> float:
    """Share of ``draws`` noise curves (the first :data:`PLATEAU` snapshots resampled to the run's
    length) on which the detector fires."""
    plateau = excess[:PLATEAU]
    steps = np.arange(len(excess))
    return float(np.mean([rise(steps, rng.choice(plateau, len(excess))) is not None for _ in range(draws)]))


def planted_errors(excess: np.ndarray, steps: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
    """|detected − true| crossing of :data:`LEVEL` (steps) on ``draws`` planted logistic rises from the
    plateau's mean to the run's final excess, midpoints and widths drawn, the plateau's noise added
    (inf: not detected)."""
    plateau, top = excess[:PLATEAU], float(np.median(excess[-PLATEAU:]))
    base = float(plateau.mean())
    if top < 1.5 * LEVEL:  # a run that ends near the level: no rise to plant that clears it clearly
        return np.array([])
    errors = []
    for _ in range(draws):
        middle = rng.uniform(steps[len(steps) // 10], steps[len(steps) // 2])
        width = rng.uniform(10, 200)
        clean = base + (top - base) / (1 + np.exp(-(steps - middle) / width))
        noisy = clean + rng.choice(plateau - base, len(steps))
        true = middle + width * np.log((LEVEL - base) / (top - LEVEL))
        found = rise(steps, noisy)
        errors.append(np.inf if found is None else abs(found - true))
    return np.array(errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument(
        "--null", type=Path, nargs="*", default=[], help="runs where no head can do statistical induction"
    )
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    before = {level: [0, 0] for level in LEVELS}  # level -> [rise before the switch, runs with both]
    fired, planted = [], []
    for run_dir in args.runs:
        steps, excess = excess_curve(run_dir)
        switch = bigram_switch(run_dir)
        found = rise(steps, excess)
        for level in LEVELS:
            at = rise(steps, excess, level)
            if at is not None and switch is not None:
                before[level][0] += at < switch[0]
                before[level][1] += 1
        fired.append(false_rises(excess, args.draws, rng))
        errors = planted_errors(excess, steps, args.draws // 10, rng)
        planted.append(errors)
        said = "none" if switch is None else f"{switch[0]:.0f} [{switch[1]:.0f}, {switch[2]:.0f}]"
        hits = (
            f"found {np.isfinite(errors).mean():.0%}, median error {np.median(errors):.0f} steps"
            if len(errors)
            else "none planted (final excess < 0.15)"
        )
        print(
            f"{run_dir}: rise {found}, bigram switch {said}; plateau {excess[:PLATEAU].mean():.3f} ± "
            f"{excess[:PLATEAU].std():.3f}, final {excess[-1]:.2f}; noise fires {fired[-1]:.1%};"
            f" planted: {hits}",
            flush=True,
        )
    for level in LEVELS:
        n_before, n = before[level]
        print(f"level {level}: the rise comes before the bigram switch in {n_before} of {n} runs with both")
    errors = np.concatenate(planted)
    print(
        f"noise: the detector fires on {np.mean(fired):.2%} of {args.draws} noise curves a run (max {np.max(fired):.2%});"
        f" planted rises: found {np.isfinite(errors).mean():.1%}, |error| median {np.median(errors):.0f},"
        f" 90 % ≤ {np.quantile(errors, 0.9):.0f} steps"
    )
    for run_dir in args.null:
        steps, excess = excess_curve(run_dir)
        print(f"null {run_dir}: rise {rise(steps, excess)}, largest excess {excess.max():.3f} (final {excess[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
