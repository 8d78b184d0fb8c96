"""Check the LLC estimator against known values, one command (needs the ``llc`` extra):

    python -m bench.llc_check

Two quadratics, where the answer is exact (linear regression at its least-squares optimum, whose
loss is ``L(w*) + ½ (w − w*)ᵀ H (w − w*)``):

- **Regular** (:data:`REGRESSION`): d = 10 weights on 8192 samples (y = x·w + N(0, 1), x ~ N(0, I)),
  no localization and a large nβ, where the learning coefficient is d/2 = 5 (a regular model).
- **Localized, at the product's settings**: the SGLD settings ``stages.llc`` defaults to (ε, nβ, γ,
  chains, draws, burn-in, batch, batches: ``conf/schema.py``'s ``LLCConfig``) on a regression whose
  Hessian has eigenvalues ``h`` log-spaced over [0.1, 30] (the default model's largest is 3 at step
  149, 28 at 400, 18 at 1500). With ``γ > 0`` the sampled posterior ``∝ exp(−nβ L(w) − γ/2 ‖w − w*‖²)``
  is Gaussian with precision ``nβ H + γ``, so ``E[nβ (L(w) − L(w*))] = ½ Σᵢ nβhᵢ / (nβhᵢ + γ)``
  exactly. Also printed: the same with 16 chains × 400 draws (the bias the product's own short
  chains hide) and that expectation with SGLD's discretisation, ``½ Σ nβhᵢ / (aᵢ (1 − ε aᵢ / 4))``
  with ``aᵢ = nβhᵢ + γ`` (the stationary variance of the discretised Langevin step).

Exits 1 if λ̂ is more than 10 % from its expectation in either case (the localized one: the mean of
three SGLD seeds), or two copies of the regular model differ by more than their spread.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys

import torch

from conf.schema import LLCConfig
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


HESSIAN_RANGE = (0.1, 30.0)
"""The localized check's Hessian eigenvalues, log-spaced over this range (d of them)."""


def localized_model(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """Linear regression at its optimum whose loss Hessian ``XᵀX / n`` has eigenvalues exactly
    log-spaced over :data:`HESSIAN_RANGE`, on the sampled set of the default ``stages.llc``
    (``batches × batch_size`` rows): ``(model, rows [n, d + 1], h [d])``."""
    settings = product_settings()
    n = settings.batch_size * LLCConfig.batches
    generator = torch.Generator().manual_seed(seed)
    h = torch.logspace(math.log10(HESSIAN_RANGE[0]), math.log10(HESSIAN_RANGE[1]), D, dtype=torch.float64)
    z = torch.randn(n, D, generator=generator, dtype=torch.float64)
    z = z - z.mean(dim=0)
    z = z @ torch.linalg.inv(torch.linalg.cholesky(z.T @ z / n)).T  # zᵀz / n = I exactly
    x = z * h.sqrt()
    y = x @ torch.randn(D, generator=generator, dtype=torch.float64) + torch.randn(
        n, generator=generator, dtype=torch.float64
    )
    model = torch.nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.linalg.lstsq(x, y[:, None]).solution.T)
    return model, torch.cat([x, y[:, None]], dim=1).float(), torch.linalg.eigvalsh(x.T @ x / n)


def product_settings() -> SGLDSettings:
    """The SGLD settings ``stages.llc`` defaults to (``conf/schema.py``)."""
    from omegaconf import OmegaConf

    from conf.objects import sgld_settings

    return sgld_settings(OmegaConf.structured(LLCConfig))


def localized_expectation(h: torch.Tensor, settings: SGLDSettings, discretised: bool = False) -> float:
    """``½ Σ nβh / (nβh + γ)``: E[λ̂] on a quadratic with Hessian eigenvalues ``h`` under the
    localized tempered posterior; ``discretised``: with SGLD's step, ``½ Σ nβh / (a (1 − ε a / 4))``."""
    a = settings.n_beta * h + settings.localization
    shrink = 1 - settings.lr * a / 4 if discretised else 1
    return float(0.5 * (settings.n_beta * h / (a * shrink)).sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the data's seed")
    args = parser.parse_args(argv)
    model, rows = regular_model(args.seed)
    s = REGRESSION
    print(
        f"llc_check: regular: linear regression, d = {D}, n = {len(rows)}, d/2 = {D / 2:g}; ε {s.lr:g}, nβ {s.n_beta:.1f},"
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
    regular_ok = abs(error) <= 0.10 and abs(first.mean - second.mean) <= max(first.std, second.std)

    model, rows, h = localized_model(args.seed)
    p = product_settings()
    exact, discretised = localized_expectation(h, p), localized_expectation(h, p, discretised=True)
    print(
        f"llc_check: localized, the product's settings: d = {D}, n = {len(rows)}, Hessian eigenvalues {h.min():.2g}-{h.max():.2g};"
        f" ε {p.lr:g}, nβ {p.n_beta:.2f}, γ {p.localization:g}, {p.chains} chains × {p.draws} draws (burn-in {p.burnin}),"
        f" batch {p.batch_size}; ½ Σ nβh/(nβh + γ) = {exact:.3f} ({discretised:.3f} with SGLD's discretisation)"
    )
    estimates = [estimate_llc(model, rows, dataclasses.replace(p, seed=seed), regression_loss) for seed in range(3)]
    mean = sum(e.mean for e in estimates) / len(estimates)
    described = ", ".join(f"{e.mean:.3f} ± {e.std:.3f}" for e in estimates)
    print(
        f"llc_check: λ̂ (SGLD seeds 0, 1, 2) = {described}; mean {mean:.3f}, {mean / exact - 1:+.1%} from the expectation"
    )
    long = estimate_llc(model, rows, dataclasses.replace(p, chains=16, draws=400), regression_loss)
    print(
        f"llc_check: 16 chains × 400 draws: λ̂ = {long.mean:.3f} ± {long.std:.3f}, {long.mean / exact - 1:+.1%} from the"
        f" expectation, {long.mean / discretised - 1:+.1%} from the discretised one"
    )
    localized_ok = abs(mean / exact - 1) <= 0.10
    ok = regular_ok and localized_ok
    print(
        f"llc_check: {'ok' if ok else 'FAILED'}: regular within 10 % of d/2 and the copies within their spread"
        f" ({'yes' if regular_ok else 'no'}); localized within 10 % of ½ Σ nβh/(nβh + γ) ({'yes' if localized_ok else 'no'})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
