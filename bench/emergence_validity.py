"""How right the emergence-law fit (:func:`metrics.dynamics.emergence_law.fit_emergence_law`) is, on
synthetic sweeps whose law is planted: ``steps = a · B^α · C^β · exp(N(0, σ²))`` over a batch size ×
context grid with seeds, the jobs past ``max_steps`` censored there, as the fit meets them in a sweep.

- **planted law**: α = −½, β = −½ (Aoyama et al.'s, in steps) and α = −½, β = +2 (Musat et al.'s
  context exponent), a few cells censored: how often each 90 % interval covers the planted exponent;
- **no dependence**: α = β = 0: how often each 90 % interval covers 0, and how often the 95 % one
  excludes it (a false dependence);
- **a law that bends**: β = 0 below the grid's middle context, +2 above it: how often the fit says it
  bends (the last local exponent minus the first excludes 0 at 95 %), against how often a straight
  law is said to bend.

    python -m bench.emergence_validity [--draws 100] [--resamples 400] [--seeds 3] [--sigma 0.15]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from metrics.dynamics.emergence_law import Law, NoLaw, Observation, fit_emergence_law

BATCH_SIZES = (8, 16, 32, 64)
CONTEXTS = (17, 33, 65, 129)
B, C = "data.batch_size", "data.seq_len"


def planted_sweep(
    rng: np.random.Generator, alpha: float, beta, seeds: int, sigma: float, censor_share: float
) -> list[Observation]:
    """A sweep of the grid × ``seeds``; ``beta``: a number, or a function of C for a law that bends.
    ``max_steps`` is set so that about ``censor_share`` of the jobs have not had their phase change."""
    jobs = []
    for b in BATCH_SIZES:
        for c in CONTEXTS:
            exponent_c = beta(c) if callable(beta) else beta * math.log(c)
            median = (
                400 * (b / 32) ** alpha * math.exp(exponent_c - (beta(33) if callable(beta) else beta * math.log(33)))
            )
            for _ in range(seeds):
                jobs.append((b, c, median * math.exp(rng.normal(0, sigma))))
    steps = np.array([t for *_, t in jobs])
    max_steps = float(np.quantile(steps, 1 - censor_share)) if censor_share > 0 else math.inf
    return [
        Observation({B: float(b), C: float(c)}, min(t, max_steps), t > max_steps, tokens_per_step=b * c)
        for b, c, t in jobs
    ]


def bent(c: float) -> float:
    """``ln`` of a context effect flat up to C = 33 and ∝ C² above it."""
    return 2 * max(math.log(c) - math.log(33), 0.0)


SCENARIOS = {
    "Aoyama: α −½, β −½, 10 % censored": dict(alpha=-0.5, beta=-0.5, censor_share=0.10),
    "Musat: α −½, β +2, 10 % censored": dict(alpha=-0.5, beta=2.0, censor_share=0.10),
    "no dependence: α 0, β 0": dict(alpha=0.0, beta=0.0, censor_share=0.0),
    "no dependence, 10 % censored": dict(alpha=0.0, beta=0.0, censor_share=0.10),
}


def run(draws: int, resamples: int, seeds: int, sigma: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    print(
        f"{draws} synthetic sweeps a row: B {BATCH_SIZES} x C {CONTEXTS} x {seeds} seeds, ln-step scatter"
        f" σ {sigma}; {resamples} resamples a fit; 90 % intervals (95 % for 'rejects')"
    )
    print(
        f"{'scenario':42s} {'fits':>5s} {'α covered':>10s} {'β covered':>10s} {'rejects 0 (α, β)':>17s} {'α median':>9s} {'β median':>9s}"
    )
    for name, planted in SCENARIOS.items():
        covered, rejected, estimates, fits = np.zeros(2), np.zeros(2), [], 0
        for _ in range(draws):
            law = fit_emergence_law(
                planted_sweep(rng, planted["alpha"], planted["beta"], seeds, sigma, planted["censor_share"]),
                resamples=resamples,
                seed=int(rng.integers(2**31)),
            )
            if isinstance(law, NoLaw):
                continue
            fits += 1
            for i, (key, truth) in enumerate(((B, planted["alpha"]), (C, planted["beta"]))):
                covered[i] += law.exponents[key].covers(truth)
                rejected[i] += law.exponents[key].rejects(0.0)
            estimates.append([law.exponents[B].estimate, law.exponents[C].estimate])
        median = np.median(np.array(estimates), axis=0) if estimates else [math.nan] * 2
        print(
            f"{name:42s} {fits:5d} {covered[0]:6.0f}/{fits:<3d} {covered[1]:6.0f}/{fits:<3d}"
            f" {rejected[0]:7.0f}, {rejected[1]:3.0f}/{fits:<3d} {median[0]:9.3f} {median[1]:9.3f}"
        )
    print("\nbending (the context's last local exponent minus its first, 95 %):")
    for name, beta in (("straight: β +2", 2.0), ("bends: β 0 below C 33, +2 above", bent)):
        said, fits = 0, 0
        for _ in range(draws):
            law = fit_emergence_law(
                planted_sweep(rng, -0.5, beta, seeds, sigma, 0.0), resamples=resamples, seed=int(rng.integers(2**31))
            )
            if isinstance(law, Law):
                fits += 1
                said += law.bends(C)
        print(f"  {name:34s} said to bend in {said}/{fits}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--resamples", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sigma", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    run(args.draws, args.resamples, args.seeds, args.sigma, args.seed)
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
