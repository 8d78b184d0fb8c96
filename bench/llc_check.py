"""Check the LLC estimator against a known value, one command (needs the ``llc`` extra):

    python -m bench.llc_check

A regular model's learning coefficient is d/2 (d its parameters): here d = 10 weights of linear
regression at their least-squares optimum on 8192 samples (y = x·w + N(0, 1), x ~ N(0, I)), so
λ = 5. Prints λ̂ with the documented settings (:data:`REGRESSION`), its chain spread, and the
estimates of two copies of the model sampled with different seeds; exits 1 if λ̂ is more than 10 %
from d/2 or the copies differ by more than their spread.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys

import torch

from metrics.dynamics.llc import SGLDSettings, estimate_llc

D, BATCH, BATCHES = 10, 1024, 8
REGRESSION = SGLDSettings(
    lr=1e-4,
    n_beta=BATCH * BATCHES / math.log(BATCH * BATCHES),
    localization=0.0,
    chains=8,
    draws=800,
    burnin=100,
    batch_size=BATCH,
)
"""ε nβ / 2 = 0.045: SGLD's discretisation inflates λ̂ by about 1 / (1 − ε nβ / 4) ≈ 2 %; the loss
relaxes in 1 / (ε nβ) ≈ 11 steps, so 100 burn-in steps are plenty; no localization (the posterior
of a quadratic loss is already Gaussian)."""


def regression_loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """``rows [batch, d + 1]`` (inputs, target) -> half squared error ``[batch, d]``, repeated over
    the d positions devinterp's per-position contract asks for (their mean is the loss)."""
    x, target = rows[:, :-1].float(), rows[:, -1].float()
    return (0.5 * (model(x)[:, 0] - target) ** 2)[:, None].expand(-1, x.shape[1])


def regular_model(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor]:
    """Linear regression at its least-squares optimum, and its data ``[8192, d + 1]``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH * BATCHES, D, generator=generator)
    y = x @ torch.randn(D, generator=generator) + torch.randn(BATCH * BATCHES, generator=generator)
    model = torch.nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.linalg.lstsq(x, y[:, None]).solution.T)
    return model, torch.cat([x, y[:, None]], dim=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the data's seed")
    args = parser.parse_args(argv)
    model, rows = regular_model(args.seed)
    s = REGRESSION
    print(
        f"llc_check: linear regression, d = {D}, n = {len(rows)}, d/2 = {D / 2:g}; ε {s.lr:g}, nβ {s.n_beta:.1f},"
        f" γ {s.localization:g}, {s.chains} chains × {s.draws} draws (burn-in {s.burnin}), batch {s.batch_size}"
    )
    first = estimate_llc(model, rows, s, regression_loss)
    second = estimate_llc(copy.deepcopy(model), rows, dataclasses.replace(s, seed=s.seed + 1), regression_loss)
    error = first.mean / (D / 2) - 1
    print(
        f"llc_check: λ̂ = {first.mean:.3f} ± {first.std:.3f} (chains' std), {error:+.1%} from d/2, {first.seconds:.1f} s"
    )
    print(
        f"llc_check: a copy, another seed: λ̂ = {second.mean:.3f} ± {second.std:.3f}; difference {abs(first.mean - second.mean):.3f}"
    )
    ok = abs(error) <= 0.10 and abs(first.mean - second.mean) <= max(first.std, second.std)
    print(f"llc_check: {'ok' if ok else 'FAILED'}: within 10 % of d/2 and the copies within their spread")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
