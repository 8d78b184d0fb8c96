"""The strategies against what is known of them, one command:

    python -m bench.strategy_nulls              # 200 draws of every case
    python -m bench.strategy_nulls --draws 50 --noise 0.1

First, the Monte-Carlo KL(truth ‖ strategy) of in-context Markov chains at T = 100 (4,000 held-out
chains, k = 2 and 3) with its standard error, against Edelman et al.'s published values.
Then the switch finder on timelines whose truth is known.

Each case draws per-sequence KL(strategy ‖ model) timelines ``[steps, 3, sequences]`` (the tensor store's
``strategies/per_sequence/*``) around known means, runs
:func:`metrics.dynamics.strategy_readings.switches_with_intervals` and judges the answer: right when it finds
exactly the true switches, each within two snapshots of its step; covered when every true step lies in
its switch's interval (widened by a snapshot). Cases: no switch (noise), no switch while every KL
halves at step 1500 (a change the strategies cannot see: their order holds), one switch, two.
``tests/metrics/test_strategy_timeline.py`` asserts the same cases on fewer draws; docs/results.md
quotes the table.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from metrics.dynamics.strategy_readings import switches_with_intervals

STEPS = np.arange(0, 3000, 20)
NAMES = ["uniform", "unigram", "bigram"]
MARGIN = 0.03  # nats between the closest strategy and the next, on a plateau
CASES = {
    "noise": ([], False),
    "every KL halves, order holds": ([], True),
    "one switch": ([1000], False),
    "two switches": ([800, 2000], False),
}


def synthetic_timeline(rng, crossings: list[int], noise: float = 0.05, b: int = 64, order_change: bool = False):
    """Per-sequence KLs ``[n_steps, 3, b]``: strategy i is closest between ``crossings[i-1]`` and
    ``crossings[i]``, each other ``MARGIN`` nats per stage away; each sequence's KL has Gaussian
    ``noise``; with ``order_change`` every KL halves at step 1500 (their order unchanged)."""
    stage = np.searchsorted(np.array(crossings), STEPS, side="right")  # the closest strategy's index
    mean = 0.3 + MARGIN * np.abs(stage[:, None] - np.arange(3)[None, :])
    if order_change:
        mean = mean * np.where(STEPS[:, None] >= 1500, 0.5, 1.0)
    return np.clip(mean[..., None] + noise * rng.standard_normal((len(STEPS), 3, b)), 0, None)


def expected(crossings: list[int]) -> list[str]:
    return [f"{NAMES[i]} → {NAMES[i + 1]}" for i in range(len(crossings))]


def judge(rng, crossings: list[int], order_change: bool, noise: float, resamples: int) -> tuple[bool, bool]:
    """(right, covered) for one draw of a case."""
    found = switches_with_intervals(
        STEPS, synthetic_timeline(rng, crossings, noise, order_change=order_change), NAMES, resamples=resamples
    )
    right = [s.label for s in found] == expected(crossings) and all(
        abs(s.step - c) <= 2 * (STEPS[1] - STEPS[0]) for s, c in zip(found, crossings)
    )
    covered = right and all(s.low - STEPS[1] <= c <= s.high + STEPS[1] for s, c in zip(found, crossings))
    return right, covered


PUBLISHED = {  # Edelman et al. 2024: KL(truth ‖ strategy) at T = 100, 4,000 chains (standard error ~0.003)
    2: {"uniform": 0.214, "unigram": 0.085, "bigram": 0.0095},
    3: {"uniform": 0.280, "unigram": 0.170, "bigram": 0.027},
}


def monte_carlo_lines(k: int, chains: int = 4000) -> dict[str, tuple[float, float]]:
    """``{strategy: (mean, standard error)}`` of KL(truth ‖ strategy) at the last position of
    ``chains`` held-out chains of ``experiment=markov_icl``'s task with ``k`` states."""
    from data.reference_predictors import HELD_OUT_STRATEGY_IDS
    from data.tasks.markov_icl import MarkovICL

    reference = MarkovICL(k=k).reference(np.arange(HELD_OUT_STRATEGY_IDS, HELD_OUT_STRATEGY_IDS + chains), k)
    truth = reference.truth[:, 0].numpy()
    lines = {}
    for name, q in reference.strategies.items():
        kl = (truth * (np.log(truth) - np.log(q[:, 0].numpy()))).sum(-1)
        lines[name] = (float(kl.mean()), float(kl.std(ddof=1) / np.sqrt(chains)))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--noise", type=float, default=0.05, help="each sequence's KL noise (nats)")
    parser.add_argument("--resamples", type=int, default=100)
    args = parser.parse_args(argv)
    print("KL(truth ‖ strategy) at T = 100, 4000 chains: ours ± standard error (Edelman et al.'s)")
    for k, published in PUBLISHED.items():
        lines = monte_carlo_lines(k)
        cells = [f"{name} {lines[name][0]:.4f} ± {lines[name][1]:.4f} ({value})" for name, value in published.items()]
        print(f"  k = {k}: " + "; ".join(cells))
    rng = np.random.default_rng(0)
    print(f"\n{args.draws} draws per case, 64 sequences, noise {args.noise} nats, margin {MARGIN} nats")
    print(f"{'case':<32}{'right':>8}{'covered':>10}")
    for case, (crossings, order_change) in CASES.items():
        results = [judge(rng, crossings, order_change, args.noise, args.resamples) for _ in range(args.draws)]
        right = sum(r for r, _ in results) / args.draws
        covered = sum(c for _, c in results) / args.draws
        print(f"{case:<32}{100 * right:>7.0f}%{100 * covered:>9.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
