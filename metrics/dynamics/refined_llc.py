"""Refined local learning coefficients of every head, every layer and the whole model, sampled as one batch.

Wang, Hoogland, van Wingerden, Furman, Murfet 2024 ("Differentiation and specialization of attention heads
via the refined local learning coefficient", arXiv 2410.02984, §2-3) restrict the LLC estimator of
:mod:`metrics.dynamics.llc` two ways:

- **weight-refined**: SGLD moves only some weights ``V`` (one head's slices of ``W_Q, W_K, W_V [h, d, e]``,
  ``W_O [h, e, d]`` and ``b_Q, b_K, b_V [h, e]``), the rest stays at ``w*``:
  ``λ̂_V(w*) = nβ (E_{w_V ~ p(w_V | w*, γ)} [L_n(w_V, w*_{-V})] − L_n(w*))``;
- **data-refined**: the loss ``L_n`` (and so the gradient SGLD follows) is another distribution's, e.g. the
  sequences of one task while the model trained on a mixture. Both at once for a head on another
  distribution's sequences.

Here a refinement is a *group* of weights, named as the rest of the project names heads: ``L1H0`` (one
head, :func:`metrics.dynamics.llc.head_masks`), ``L1`` (every weight of layer 1: its heads, ``b_O`` and
its norm's gain, devinterp's ``create_param_masks(model, "l1")``) and ``model`` (every weight: the
plain LLC). The distribution is the ``rows`` given: held-out sequences of the training distribution
give the weight-refined LLCs, another distribution's sequences the data-refined ones.

**One batch for all groups.** devinterp cannot batch across masks: :func:`~devinterp.slt.sampling.sample`
takes one ``param_masks`` for all its chains and runs the chains one after another
(``sample_single_chain``: a deep copy of the model, one optimizer whose parameter groups all belong to
that one chain), so G groups of C chains cost G × C serial chains, each a single model's forward and
backward a step (on a GPU at the default shape, 2 × 2 heads and d_model 64, launch-bound). Here every
(group, chain) is a *member* of one :class:`~models.ensemble.EnsembleTransformer` holding ``G·C``
copies of ``w*`` (its member axis), all run on the same batch in one forward and one backward a step;
member ``m`` moves only its group's coordinates (a 0/1 mask per weight, ``[G·C, ...]``, broadcast over
the axes it does not vary on). Each member costs a whole model's forward and backward, its masked-out
weight gradients included (:func:`step_flops`); a weight no member moves carries no gradient.

**devinterp's update, exactly.** ``sample(..., sampling_method="sgmcmc_sgld")`` as
:func:`~metrics.dynamics.llc.estimate_llc` calls it (noise level 1, no weight decay, no bounding box,
no initial noise, no shuffle): per chain ``c`` devinterp seeds ``torch.manual_seed(seed + c)`` (its
``set_seed``) after copying the model, and at each step ``t`` (batch ``t mod batches``) evaluates the
per-token loss at ``w_t``, backpropagates its mean (taken in float32), then, for every parameter
``p`` of ``param_masks`` in that dict's order (``SGMCMC.step``, its mask as a ``MaskPreconditioner``):

    d = mask · (nβ ∇_p L_B(w_t) + γ (p − p*))
    p ← p − ε/2 · d
    ξ ~ N(0, 1) of p's whole shape, drawn from the global generator in the default dtype
    p ← p + √ε · mask · ξ

So the noise is drawn for the *whole* parameter and then masked: a head's chain draws the full
``W_Q, W_K, W_V, W_O`` of its layer each step, and every head of one layer (and of any layer of the
same shapes) on chain ``c`` sees the same draws, sliced to its own head. This sampler keeps one
generator per distinct (seed, parameter shapes) stream, seeded ``seed + c``, draws exactly devinterp's
sequence from it, and gives each member its stream's draw of each of its parameters: the chains are
devinterp's, draw for draw (``tests/metrics/test_refined_llc.py``: equal to rounding in float64 and
in float32).

The reduction is :func:`~metrics.dynamics.llc.estimate_llc`'s: draw ``t`` (after ``burnin`` steps) is
paired with ``L`` at ``w*`` on the same batch, ``trace = nβ (L_B(w_t) − L_B(w*))``, each chain's λ̂ the
mean of its trace; drift and spread as there. A member whose loss turns non-finite is devinterp's
failed chain: its group's estimate is NaN with ``diverged`` 1 (:func:`~metrics.dynamics.llc.llc_record`'s
record), the others are unaffected (members share no arithmetic).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from metrics.dynamics.llc import LLCEstimate, SGLDSettings, head_masks
from models.ensemble import EnsembleTransformer
from models.transformer import AttentionOnlyTransformer, TransformerShape

ParamMasks = dict[str, Tensor | None]
"""devinterp's ``param_masks``: parameter name -> 0/1 mask of its shape, or None for all of it; a
parameter left out is not sampled."""

GROUP_KINDS = ("heads", "layers", "model")
"""Kinds of group :func:`group_names` expands: every head ``LxHy``, every layer ``Lx``, the ``model``."""

_GROUP = re.compile(r"L(\d+)(?:H(\d+))?")


def group_names(shape: TransformerShape, groups: Sequence[str] = GROUP_KINDS) -> list[str]:
    """The groups ``groups`` names, in order and once each: a kind of :data:`GROUP_KINDS` stands for all of
    its groups (``heads`` -> ``L0H0, L0H1, ...``), anything else is a group's name (``L1H0``, ``L0``, ``model``)."""
    names: list[str] = []
    for entry in groups:
        if entry == "heads":
            names += [f"L{l}H{h}" for l in range(shape.n_layers) for h in range(shape.n_heads)]
        elif entry == "layers":
            names += [f"L{l}" for l in range(shape.n_layers)]
        else:
            names.append(entry)
    return list(dict.fromkeys(names))


def group_masks(model: AttentionOnlyTransformer, name: str) -> ParamMasks:
    """devinterp ``param_masks`` of the group ``name``: ``model`` every weight (no mask), ``Lx`` every weight
    of layer x (devinterp's ``"lx"``), ``LxHy`` head y of layer x (:func:`~metrics.dynamics.llc.head_masks`)."""
    if name == "model":
        return {n: None for n, _ in model.named_parameters()}
    match = _GROUP.fullmatch(name)
    shape = model.shape
    if match is None:
        raise ValueError(f"unknown group {name!r}: model, Lx (a layer) or LxHy (a head), or one of {GROUP_KINDS}")
    layer = int(match[1])
    if layer >= shape.n_layers:
        raise ValueError(f"group {name}: the model has {shape.n_layers} layers")
    if match[2] is None:
        return {n: None for n, _ in model.named_parameters() if n.startswith(f"layers.{layer}.")}
    if int(match[2]) >= shape.n_heads:
        raise ValueError(f"group {name}: the model has {shape.n_heads} heads a layer")
    return head_masks(model, layer, int(match[2]))


@dataclass(frozen=True)
class MemberDraws:
    """What :func:`batched_sgld` sampled: ``losses [groups, chains, draws]``, each draw's ``L_B(w_t)`` (the
    model's dtype, at least float32); ``reference [batches]``, ``L_j(w*)`` of each batch of the sampled set;
    ``finite [groups, chains]``, whether every loss of the chain was finite; ``seconds``, the wall time of
    the whole batched run; ``flops``, its forward and backward GEMM FLOPs (:func:`step_flops`)."""

    losses: Tensor
    reference: Tensor
    finite: Tensor
    seconds: float
    flops: float


def batched_sgld(
    model: AttentionOnlyTransformer, rows: Tensor, settings: SGLDSettings, masks: Sequence[ParamMasks]
) -> MemberDraws:
    """``settings.chains`` SGLD chains for each of ``masks`` (devinterp ``param_masks``, one a group), all as
    members of one ensemble, each on the same batches as :func:`~metrics.dynamics.llc.estimate_llc` (draw
    ``t`` on batch ``(burnin + t) mod batches`` of ``rows [n, seq]``; ``n`` a multiple of the batch size)
    with devinterp's update and noise (the module docstring). ``model`` is left as it was."""
    n, batch = rows.shape[0], settings.batch_size
    if n % batch or n == 0:
        raise ValueError(f"the sampled set holds {n} rows: it must be a whole number of batches of {batch}")
    if settings.draws < 3:
        raise ValueError(f"draws={settings.draws}: an estimate needs at least 3 draws")
    if not masks:
        raise ValueError("no group to sample")
    first = next(model.parameters())
    device, rows = first.device, rows.to(first.device)
    chains, steps = settings.chains, settings.burnin + settings.draws
    members = len(masks) * chains  # member m: group m // chains, chain m % chains
    started = time.perf_counter()
    with torch.inference_mode(False), torch.enable_grad():
        reference = _batch_losses(model, rows, batch)
        ensemble = EnsembleTransformer([model] * members).to(device)
        if model.intervened:
            ensemble.set_changes([[layer.changes for layer in model.layers]] * members)
        plan = _update_plan(model, ensemble, masks, chains, settings.seed)
        losses = torch.empty(members, settings.draws, dtype=reference.dtype, device=device)
        finite = torch.ones(members, dtype=torch.bool, device=device)
        batches = rows.split(batch)
        for step in range(steps):
            tokens = batches[step % len(batches)]
            token_losses = _token_losses(ensemble(tokens.expand(members, -1, -1)), tokens)  # (members, b, t - 1)
            # devinterp backpropagates the mean of the float32 per-token losses
            token_losses.float().mean(dim=(1, 2)).sum().backward()
            step_losses = token_losses.detach().mean(dim=(1, 2))
            finite &= torch.isfinite(step_losses)
            if step >= settings.burnin:
                losses[:, step - settings.burnin] = step_losses
            plan.step(settings)
    moving = [name for name, p in ensemble.named_parameters() if p.requires_grad]
    flops = steps * members * step_flops(model.shape, batch, rows.shape[1], moving)
    return MemberDraws(
        losses=losses.view(len(masks), chains, settings.draws).cpu(),
        reference=reference.cpu(),
        finite=finite.view(len(masks), chains).cpu(),
        seconds=time.perf_counter() - started,
        flops=flops,
    )


def refined_estimates(
    model: AttentionOnlyTransformer,
    rows: Tensor,
    settings: SGLDSettings,
    groups: Sequence[str] = GROUP_KINDS,
) -> dict[str, LLCEstimate | None]:
    """λ̂ of each group of ``groups`` (:func:`group_names`: ``heads``, ``layers``, ``model`` or names like
    ``L1H0``) at ``model``'s weights, all sampled at once (:func:`batched_sgld`) on ``rows [n, seq]``:
    held-out sequences of the model's training distribution for the weight-refined LLCs (Wang et al.
    2024), another distribution's for the data-refined ones. Each group's :class:`LLCEstimate` is what
    :func:`~metrics.dynamics.llc.estimate_llc` returns with that group's ``param_masks`` (its ``seconds``:
    the batched run's, shared by every group); None where a chain diverged (a non-finite loss)."""
    names = group_names(model.shape, groups)
    draws = batched_sgld(model, rows, settings, [group_masks(model, name) for name in names])
    batches = rows.shape[0] // settings.batch_size
    batch_of_draw = (settings.burnin + torch.arange(settings.draws)) % batches
    trace = settings.n_beta * (draws.losses - draws.reference[batch_of_draw])  # (groups, chains, draws)
    return {
        name: _estimate(trace[g], draws.reference, draws.seconds) if draws.finite[g].all() else None
        for g, name in enumerate(names)
    }


def refined_llcs(
    model: AttentionOnlyTransformer,
    rows: Tensor,
    settings: SGLDSettings,
    settle_tolerance: float,
    groups: Sequence[str] = GROUP_KINDS,
) -> dict[str, dict[str, float]]:
    """Each group's estimate (:func:`refined_estimates`) as :func:`~metrics.dynamics.llc.llc_record`'s flat
    numbers: ``mean``, ``std``, ``drift``, ``settled`` and ``diverged`` (0/1), ``init_loss``, ``seconds``
    (the batched run's), ``chain_0``, ``chain_1``, ...; a diverged group's are NaN with ``diverged`` 1.
    ``{"L0H0": {...}, ..., "L0": {...}, "model": {...}}`` for ``rows`` of the training distribution are the
    weight-refined LLCs, for another distribution's rows the data-refined ones."""
    started = time.perf_counter()
    estimates = refined_estimates(model, rows, settings, groups)
    seconds = time.perf_counter() - started
    records = {}
    for name, estimate in estimates.items():
        if estimate is None:
            nan = math.nan
            records[name] = dict(
                mean=nan,
                std=nan,
                drift=nan,
                settled=0.0,
                diverged=1.0,
                init_loss=nan,
                seconds=seconds,
                **{f"chain_{i}": nan for i in range(settings.chains)},
            )
            continue
        records[name] = dict(
            mean=estimate.mean,
            std=estimate.std,
            drift=estimate.drift,
            settled=float(estimate.settled(settle_tolerance)),
            diverged=0.0,
            init_loss=estimate.init_loss,
            seconds=seconds,
            **{f"chain_{i}": value for i, value in enumerate(estimate.per_chain)},
        )
    return records


def step_flops(shape: TransformerShape, batch: int, seq: int, moving: Collection[str]) -> float:
    """GEMM FLOPs of one member's SGLD step on ``batch × seq`` tokens as the ensemble runs it, where the
    weights ``moving`` (the single model's names) carry gradients. Forward: per layer the Q, K, V and O
    projections (``2·b·t·d·h·e`` each), the scores and the mixing (``2·b·h·t²·e`` each, dense), and the
    unembedding (``2·b·t·d·v``). Backward, from the first layer whose input needs a gradient on: each
    GEMM's input gradient (the scores' and mixing's two each; the first such layer's Q, K, V inputs only
    when the embedding moves); each moving ``W_Q, W_K, W_V, W_O`` and ``W_U``'s weight gradient (every member
    carries them for every member's moving weights, masked afterwards)."""
    b, t, d, h, e, v = batch, seq, shape.d_model, shape.n_heads, shape.d_head, shape.d_vocab
    projection, attention, unembedding = 2 * b * t * d * h * e, 2 * 2 * b * h * t * t * e, 2 * b * t * d * v
    layers = shape.n_layers
    forward = layers * (4 * projection + attention) + unembedding
    moving_layers = [l for l in range(layers) if any(name.startswith(f"layers.{l}.") for name in moving)]
    start = -1 if {"W_E", "W_pos"} & set(moving) else min(moving_layers, default=layers)
    inputs = unembedding if start < layers else 0
    for l in range(max(start, 0), layers):
        inputs += 2 * attention + projection + (3 * projection if l > start else 0)
    weights = sum(projection for l in range(layers) for m in "QKVO" if f"layers.{l}.W_{m}" in moving)
    return float(forward + inputs + weights + (unembedding if "W_U" in moving else 0))


# ---------------------------------------------------------------- the update


def _token_losses(logits: Tensor, tokens: Tensor) -> Tensor:
    """Next-token cross-entropy of every member, ``logits [n, b, t, v]`` on ``tokens [b, t]`` -> ``[n, b, t - 1]``,
    in the logits' dtype (at least float32, as :func:`~metrics.dynamics.llc.next_token_loss`)."""
    n, b, t, v = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    targets = tokens[:, 1:].expand(n, -1, -1).flatten()
    return F.cross_entropy(logits[:, :, :-1].flatten(0, 2).to(dtype), targets, reduction="none").view(n, b, t - 1)


def _batch_losses(model: AttentionOnlyTransformer, rows: Tensor, batch: int) -> Tensor:
    """``L_j(w*)`` of each consecutive batch of ``rows``: ``[batches]`` (as :func:`_token_losses` reduces them)."""
    with torch.no_grad():
        return torch.stack([_token_losses(model(chunk)[None], chunk).mean() for chunk in rows.split(batch)])


@dataclass
class _Weight:
    """One stacked parameter ``value [members, ...]`` of the ensemble, its centre ``w* [...]``, the members'
    masks (broadcastable to ``value``), and where each member's noise comes from: ``sources[i] = (stream,
    k)``, the k-th draw of a stream, and ``source_of [members]``, an index into ``sources``."""

    value: Tensor
    center: Tensor
    mask: Tensor
    sources: list[tuple[int, int]]
    source_of: Tensor


class _UpdatePlan:
    """devinterp's SGLD step for every member at once (the module docstring), with its noise streams."""

    def __init__(self, weights: list[_Weight], streams: list[tuple[torch.Generator, list[torch.Size]]]) -> None:
        self.weights, self.streams = weights, streams

    @torch.no_grad()
    def step(self, settings: SGLDSettings) -> None:
        device = self.weights[0].value.device
        drawn = [
            [torch.normal(mean=0.0, std=1.0, size=size, device=device, generator=generator) for size in sizes]
            for generator, sizes in self.streams
        ]
        for w in self.weights:
            p = w.value
            d_p = p.grad.mul(settings.n_beta)
            if settings.localization:
                d_p.add_(settings.localization * (p - w.center))
            p.add_(w.mask * d_p, alpha=-0.5 * settings.lr)
            noise = torch.stack([drawn[stream][k] for stream, k in w.sources])[w.source_of]
            p.add_(w.mask * noise, alpha=settings.lr**0.5)
            p.grad = None


def _update_plan(
    model: AttentionOnlyTransformer,
    ensemble: EnsembleTransformer,
    masks: Sequence[ParamMasks],
    chains: int,
    seed: int,
) -> _UpdatePlan:
    """Masks, centres and noise sources of every ensemble weight for members ``(group g, chain c)`` at
    ``g · chains + c``; a weight no member moves is frozen. devinterp draws, for each parameter of a
    group's ``param_masks`` in order, a normal of the parameter's whole shape from the generator seeded
    ``seed + c``: members whose (seed, shapes) agree share one stream."""
    single = dict(model.named_parameters())
    streams: dict[tuple, int] = {}
    generators: list[tuple[torch.Generator, list[torch.Size]]] = []
    place: dict[tuple[int, str], tuple[int, int]] = {}  # (member, parameter) -> (stream, k)
    device = next(model.parameters()).device
    for g, group in enumerate(masks):
        unknown = set(group) - set(single)
        if unknown:
            raise ValueError(f"param_masks name weights the model does not have: {sorted(unknown)}")
        sizes = [single[name].shape for name in group]
        for c in range(chains):
            key = (seed + c, tuple(sizes))
            if key not in streams:
                streams[key] = len(generators)
                generators.append((torch.Generator(device=device).manual_seed(seed + c), sizes))
            for k, name in enumerate(group):
                place[g * chains + c, name] = (streams[key], k)
    weights = []
    members = len(masks) * chains
    for name, value in ensemble.named_parameters():
        moving = [m for m in range(members) if (m, name) in place]
        value.requires_grad_(bool(moving))
        if not moving:
            continue
        center = single[name].detach()
        mask = torch.zeros_like(value)
        for m in moving:
            given = masks[m // chains][name]
            mask[m] = 1.0 if given is None else given.to(mask)
        sources = list(dict.fromkeys(place[m, name] for m in moving))
        source_of = torch.zeros(members, dtype=torch.long, device=device)
        for m in moving:
            source_of[m] = sources.index(place[m, name])
        weights.append(_Weight(value, center, _compact(mask), sources, source_of))
    return _UpdatePlan(weights, generators)


def _compact(mask: Tensor) -> Tensor:
    """``mask [members, ...]`` reduced to size 1 along every axis it is constant on (it broadcasts back)."""
    for axis in range(1, mask.dim()):
        first = mask.narrow(axis, 0, 1)
        if torch.equal(mask, first.expand_as(mask)):
            mask = first
    return mask


def _estimate(trace: Tensor, reference: Tensor, seconds: float) -> LLCEstimate:
    """:func:`~metrics.dynamics.llc.estimate_llc`'s reduction of ``trace [chains, draws]``."""
    chains, draws = trace.shape
    per_chain = trace.mean(dim=1)
    third = max(1, draws // 3)
    mean = float(per_chain.mean())
    drift = float(trace[:, -third:].mean() - trace[:, :third].mean()) / abs(mean) if mean else math.inf
    return LLCEstimate(
        mean=mean,
        std=float(per_chain.std()) if chains > 1 else 0.0,
        per_chain=per_chain.tolist(),
        init_loss=float(reference.mean()),
        drift=drift,
        seconds=seconds,
        trace=trace,
    )
