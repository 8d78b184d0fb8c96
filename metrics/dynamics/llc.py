"""The local learning coefficient (LLC) of a model at one point of its training, by SGLD (devinterp).

    λ̂(w*) = nβ · ( E_{w ~ p(w | w*, γ)} [L_n(w)] − L_n(w*) )

Lau et al. 2023 ("Quantifying degeneracy in singular models via the learning coefficient"), as
devinterp samples it: SGLD chains started at ``w*``, step ``Δw = −ε/2 (nβ ∇L_B(w) + γ (w − w*)) +
N(0, ε)`` on mini-batches ``B``. For a regular model (full-rank Hessian at ``w*``) λ = d/2, d the
number of sampled parameters; Hoogland et al. 2024 track λ̂ over training to find stages.

devinterp does the sampling (:func:`devinterp.slt.sampling.sample`); the reduction is ours, for
one reason that changes the number: devinterp's ``compute_llc`` subtracts an ``init_loss``
averaged over ``num_init_loss_batches`` batches that are not the batches the chains saw (its
``epoch_mode="cycle"`` replays the first epoch's batches), and it averages the burn-in too. With 10
parameters of linear regression (d/2 = 5) that read 3.6-7.1 depending on batch size. Here the
sampled set is exactly ``batches × batch_size`` sequences served in a fixed order (no shuffle), so
draw ``t`` saw batch ``t mod batches``, and each draw's loss is paired with ``L`` at ``w*`` on the
same batch (a control variate: the batches' own noise cancels); burn-in is left out.

**Which n nβ stands for.** Lau et al. 2023 define the estimator at ``β* = 1 / ln n`` with ``n`` the
number of samples ``L_n`` averages over; with SGLD on mini-batches devinterp's ``default_nbeta``
takes ``n`` to be the batch size, and so do Hoogland et al. 2024 for their language model
(``num_samples`` = the SGLD batch of 100 sequences, nβ = 100 / ln 100; ``timaeus-research/icl``).
Here too: ``n`` is the number of sequences in one SGLD batch (``stages.llc.batch_size``, nβ =
32 / ln 32 = 9.2 by default), because the gradient each step follows is a batch's. Its noise
enters the chain as ``(ε nβ / 2)² Var(∇L_B)`` a step beside the injected ``ε``, so it grows with
nβ²: at nβ = 9.2 it adds about 3 % to λ̂ on ``bench.llc_check``'s localized quadratic; with ``n`` the
8192 tokens of the sampled set (nβ = 909) the default model's largest Hessian eigenvalue (28 at
the phase change) would need ε < 2 / (nβ h) ≈ 8e-5 to stay stable, and the localization's
relaxation, 1 / (ε γ) steps, chains of several hundred draws: many times the 5 s an estimate
may take. The price of the small nβ is that γ dominates: only directions with ``nβ h ≳ γ`` count
fully (``½ Σ nβhᵢ / (nβhᵢ + γ)`` on a quadratic), so λ̂ is comparable only within one (ε, nβ, γ).

devinterp is an optional extra (``pip install -e '.[llc]'``): it is imported only when an
estimate is asked for, and :func:`require_devinterp` says in one line how to install it.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EXTRA = "llc"
INSTALL_HINT = f"pip install -e '.[{EXTRA}]'"

LossFn = Callable[[nn.Module, Tensor], Tensor]
"""``(model, rows [batch, cols]) -> per-position loss [batch, cols - 1]``: devinterp's contract."""


class LLCUnavailable(RuntimeError):
    """devinterp (the ``llc`` extra) is not installed."""


def require_devinterp() -> None:
    """Raise :class:`LLCUnavailable` with the one line that installs the extra, unless devinterp imports."""
    try:
        import datasets  # noqa: F401
        import devinterp.slt.sampling  # noqa: F401
    except ImportError:
        raise LLCUnavailable(
            f"the local learning coefficient needs devinterp, the '{EXTRA}' extra: {INSTALL_HINT}"
        ) from None


def per_position_losses(model: nn.Module, tokens: Tensor) -> Tensor:
    """Our training loss per position: ``tokens [batch, seq] -> cross-entropy [batch, seq - 1]``."""
    logits = model(tokens)[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none").view(
        tokens.shape[0], -1
    )


@dataclass(frozen=True)
class SGLDSettings:
    """What one estimate samples: ``chains`` chains of ``burnin + draws`` SGLD steps of size ``lr``
    (ε) at inverse temperature ``n_beta`` (nβ) with localization ``localization`` (γ), on batches of
    ``batch_size`` rows; ``seed`` fixes the noise. (Defaults live in ``conf/schema.py``'s ``LLCConfig``.)"""

    lr: float
    n_beta: float
    localization: float
    chains: int
    draws: int
    burnin: int
    batch_size: int
    seed: int = 0


@dataclass(frozen=True)
class LLCEstimate:
    """One estimate, with what it needs to be judged.

    ``per_chain [chains]`` is each chain's λ̂; ``mean`` and ``std`` (sample std across chains, ddof 1)
    summarise them; ``trace [chains, draws]`` is each draw's ``nβ (L_B(w_t) − L_B(w*))``;
    ``drift`` is (mean of the last third of the draws − mean of the first third) / |mean|: near 0
    when the chains have settled; ``init_loss`` is ``L(w*)`` over the sampled set."""

    mean: float
    std: float
    per_chain: list[float]
    init_loss: float
    drift: float
    seconds: float
    trace: Tensor = field(repr=False)

    def settled(self, tolerance: float) -> bool:
        return math.isfinite(self.drift) and abs(self.drift) <= tolerance

    @property
    def spread(self) -> float:
        """Chain spread relative to the estimate: ``std / |mean|``."""
        return self.std / abs(self.mean) if self.mean else math.inf


def batch_losses(model: nn.Module, rows: Tensor, batch_size: int, loss_fn: LossFn) -> Tensor:
    """``L_j(w)`` of each consecutive batch ``j`` of ``rows``: ``[batches]``, without gradients."""
    with torch.no_grad():
        return torch.stack([loss_fn(model, chunk).float().mean() for chunk in rows.split(batch_size)])


def head_masks(model: nn.Module, layer: int, head: int) -> dict[str, Tensor]:
    """devinterp ``param_masks`` that sample only head ``head`` of layer ``layer``: its slices of
    ``W_Q, W_K, W_V [h, d, e]``, ``W_O [h, e, d]`` and, when the model has them, ``b_Q, b_K, b_V [h, e]``."""
    masks = {}
    for name, parameter in model.named_parameters():
        prefix, _, tail = name.rpartition(".")
        if prefix == f"layers.{layer}" and tail in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V"):
            mask = torch.zeros_like(parameter)
            mask[head] = 1.0
            masks[name] = mask
    if not masks:
        raise ValueError(f"layer {layer} has no attention weights in this model")
    return masks


def estimate_llc(
    model: nn.Module,
    rows: Tensor,
    settings: SGLDSettings,
    loss_fn: LossFn = per_position_losses,
    param_masks: dict[str, Tensor] | None = None,
) -> LLCEstimate:
    """λ̂ at ``model``'s weights, sampling on ``rows [n, cols]`` (``n`` a multiple of ``batch_size``;
    for a language model the token sequences). ``param_masks`` restricts sampling to some weights
    (:func:`head_masks`). The model is left as it was (devinterp samples a copy)."""
    require_devinterp()
    from datasets import Dataset
    from devinterp.slt.sampling import sample

    n, batch = rows.shape[0], settings.batch_size
    if n % batch or n == 0:
        raise ValueError(f"the sampled set holds {n} rows: it must be a whole number of batches of {batch}")
    batches = n // batch
    if settings.draws < 3:
        raise ValueError(f"draws={settings.draws}: an estimate needs at least 3 draws")
    dataset = Dataset.from_dict({"input_ids": rows.cpu().numpy()}).with_format("torch")
    was_training = model.training
    started = time.perf_counter()
    reference = batch_losses(model.eval(), rows, batch, loss_fn).cpu()  # L_j(w*), j = 0 .. batches - 1
    masks = param_masks or {name: None for name, _ in model.named_parameters()}
    # devinterp calls gc.collect() around every chain: frozen, the objects that exist now are not walked
    # by them (0.3 s a call in a process that has imported W&B and Lightning); any garbage among them
    # waits for the first collection after gc.unfreeze() below
    gc.freeze()
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():  # a tqdm bar per chain
            warnings.filterwarnings("ignore", message="Sampling without output_path")  # the draws are reduced here
            samples = sample(
                model=model,
                dataset=dataset,
                observables={},
                param_masks=masks,
                lr=settings.lr,
                n_beta=settings.n_beta,
                localization=settings.localization,
                num_chains=settings.chains,
                num_draws=settings.draws,
                num_burnin_steps=settings.burnin,
                batch_size=batch,
                num_init_loss_batches=batches,
                shuffle=False,
                init_seed=settings.seed,
                loss_fn=loss_fn,
                device=str(next(model.parameters()).device),
            )
    finally:
        gc.unfreeze()
        model.train(was_training)
    data = samples.dataset
    drawn = torch.as_tensor(data.sampling_loss.values, device="cpu").float().mean(dim=(2, 3))  # [chains, draws]
    if not torch.isfinite(drawn).all():
        raise FloatingPointError("an SGLD chain diverged (a non-finite loss): lower llc.lr or raise llc.localization")
    batch_of_draw = (settings.burnin + torch.arange(settings.draws, device="cpu")) % batches
    trace = settings.n_beta * (drawn - reference[batch_of_draw])
    per_chain = trace.mean(dim=1)
    third = max(1, settings.draws // 3)
    mean = float(per_chain.mean())
    drift = float(trace[:, -third:].mean() - trace[:, :third].mean()) / abs(mean) if mean else math.inf
    return LLCEstimate(
        mean=mean,
        std=float(per_chain.std()) if settings.chains > 1 else 0.0,
        per_chain=per_chain.tolist(),
        init_loss=float(reference.mean()),
        drift=drift,
        seconds=time.perf_counter() - started,
        trace=trace,
    )


def llc_record(
    model: nn.Module,
    rows: Tensor,
    settings: SGLDSettings,
    settle_tolerance: float,
    param_masks: dict[str, Tensor] | None = None,
) -> dict[str, float]:
    """One estimate (:func:`estimate_llc`) as flat numbers: ``mean``, ``std``, ``drift``, ``settled``
    and ``diverged`` (0/1), ``init_loss``, ``seconds``, and each chain's λ̂ as ``chain_0``, ``chain_1``,
    ... (their spread is what a stage boundary must clear). A chain that diverged gives NaN and
    ``diverged`` 1 rather than an error: one bad estimate must not end a trajectory's analysis or a
    training run."""
    started = time.perf_counter()
    try:
        estimate = estimate_llc(model, rows, settings, param_masks=param_masks)
    except FloatingPointError:
        return estimate_record(None, settings.chains, settle_tolerance, time.perf_counter() - started)
    return estimate_record(estimate, settings.chains, settle_tolerance, estimate.seconds)


def estimate_record(
    estimate: LLCEstimate | None, chains: int, settle_tolerance: float, seconds: float
) -> dict[str, float]:
    """:func:`llc_record`'s flat numbers of ``estimate`` (None: a diverged one, NaN with ``diverged`` 1)."""
    if estimate is None:
        nan = math.nan
        return dict(
            mean=nan,
            std=nan,
            drift=nan,
            settled=0.0,
            diverged=1.0,
            init_loss=nan,
            seconds=seconds,
            **{f"chain_{i}": nan for i in range(chains)},
        )
    return dict(
        mean=estimate.mean,
        std=estimate.std,
        drift=estimate.drift,
        settled=float(estimate.settled(settle_tolerance)),
        diverged=0.0,
        init_loss=estimate.init_loss,
        seconds=seconds,
        **{f"chain_{i}": value for i, value in enumerate(estimate.per_chain)},
    )
