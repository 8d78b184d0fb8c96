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
(group, chain) is a *member*, and all members run on the same batch a step, with a member axis over
the weights they move (as :class:`~models.ensemble_transformer.EnsembleTransformer` stacks whole models), through the
model's one forward pass (:mod:`models.forward`). The members
are split into *families* by the weights their group moves (layer 1's heads and layer 1 all move
``layers.1.W_Q, W_K, W_V, W_O``; the model moves everything): a family's moving weights are leaves
``[members, ...]``, every other weight is ``w*``'s, shared and without gradient. Member ``m`` moves only
its group's coordinates (a 0/1 mask per weight, broadcast over the axes it does not vary on). So a
member whose first moving layer is ``l`` starts from ``w*``'s stream entering ``l`` (computed once a
batch, in the pass that gives ``L_j(w*)``), runs the layers from ``l`` on and backpropagates to ``l``
alone, and computes only its own family's weight gradients (:func:`step_flops`).

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

from metrics.dynamics.llc import LLCEstimate, SGLDSettings, estimate_record, head_masks
from models import forward
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
    the whole batched run; ``flops``, its GEMM FLOPs: every member's steps (:func:`step_flops`) and the one
    forward pass of ``w*`` over the batches."""

    losses: Tensor
    reference: Tensor
    finite: Tensor
    seconds: float
    flops: float


def batched_sgld(
    model: AttentionOnlyTransformer, rows: Tensor, settings: SGLDSettings, masks: Sequence[ParamMasks]
) -> MemberDraws:
    """``settings.chains`` SGLD chains for each of ``masks`` (devinterp ``param_masks``, one a group), all as
    members of one batched run (the module docstring), each on the same batches as :func:`~metrics.dynamics.llc.estimate_llc` (draw
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
        single = {name: p.detach() for name, p in model.named_parameters()}
        families = _families(model, masks, chains)
        batches = rows.split(batch)
        reference, prefixes = _reference_pass(model, single, batches, {family.start for family in families})
        plan = _update_plan(model, families, masks, chains, settings.seed)
        losses = torch.empty(members, settings.draws, dtype=reference.dtype, device=device)
        finite = torch.ones(members, dtype=torch.bool, device=device)
        step_losses = torch.empty(members, dtype=reference.dtype, device=device)
        for step in range(steps):
            index = step % len(batches)
            tokens = batches[index]
            for family in families:
                token_losses = _token_losses(_family_logits(model, family, prefixes[index], tokens), tokens)
                if token_losses.requires_grad:  # devinterp backpropagates the mean of the float32 per-token losses
                    token_losses.float().mean(dim=(1, 2)).sum().backward()
                step_losses[family.members] = token_losses.detach().mean(dim=(1, 2))
            finite &= torch.isfinite(step_losses)
            if step >= settings.burnin:
                losses[:, step - settings.burnin] = step_losses
            plan.step(settings)
    shape, seq = model.shape, rows.shape[1]
    member_flops = sum(len(f.members) * step_flops(shape, batch, seq, f.weights) for f in families)
    flops = steps * member_flops + len(batches) * _pass_flops(shape, batch, seq)
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
    batch_of_draw = (settings.burnin + torch.arange(settings.draws, device="cpu")) % batches
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
    return {
        name: estimate_record(estimate, settings.chains, settle_tolerance, seconds)
        for name, estimate in estimates.items()
    }


def step_flops(shape: TransformerShape, batch: int, seq: int, moving: Collection[str]) -> float:
    """GEMM FLOPs of one member's SGLD step on ``batch × seq`` tokens as :func:`batched_sgld` runs it, the member
    moving the weights ``moving`` (the single model's names). Forward, from the first layer whose weights move
    (the stream before it is ``w*``'s, computed once a batch for every member): per layer the Q, K, V and O
    projections (``2·b·t·d·h·e`` each), the scores and the mixing (``2·b·h·t²·e`` each, dense), and the
    unembedding of every position but the last (``2·b·(t−1)·d·v``). Backward, from that layer on: each GEMM's input gradient (the scores' and
    mixing's two each; that layer's Q, K, V inputs only when an embedding moves); the weight gradients of the
    moving ``W_Q, W_K, W_V, W_O`` and ``W_U`` alone (a member carries no other's)."""
    b, t, d, h, e, v = batch, seq, shape.d_model, shape.n_heads, shape.d_head, shape.d_vocab
    projection, attention, unembedding = 2 * b * t * d * h * e, 2 * 2 * b * h * t * t * e, 2 * b * (t - 1) * d * v
    layers, start = shape.n_layers, _first_layer(shape, moving)
    forward = (layers - max(start, 0)) * (4 * projection + attention) + unembedding
    inputs = unembedding if start < layers else 0
    for l in range(max(start, 0), layers):
        inputs += 2 * attention + projection + (3 * projection if l > start else 0)
    weights = sum(projection for l in range(layers) for m in "QKVO" if f"layers.{l}.W_{m}" in moving)
    return float(forward + inputs + weights + (unembedding if "W_U" in moving else 0))


def _pass_flops(shape: TransformerShape, batch: int, seq: int) -> float:
    """GEMM FLOPs of one forward pass of the single model (:func:`step_flops`'s terms)."""
    b, t, d, h, e, v = batch, seq, shape.d_model, shape.n_heads, shape.d_head, shape.d_vocab
    return float(shape.n_layers * (4 * 2 * b * t * d * h * e + 2 * 2 * b * h * t * t * e) + 2 * b * (t - 1) * d * v)


# ---------------------------------------------------------------- the update


def _token_losses(logits: Tensor, tokens: Tensor) -> Tensor:
    """Next-token cross-entropy of every member, ``logits [n, b, t - 1, v]`` (those of every position but the last,
    :func:`_unembed`'s) on ``tokens [b, t]`` -> ``[n, b, t - 1]``, in the logits' dtype (at least float32, as
    :func:`~metrics.dynamics.llc.per_position_losses`)."""
    n, b, s, v = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    targets = tokens[:, 1:].expand(n, -1, -1).flatten()
    return F.cross_entropy(logits.flatten(0, 2).to(dtype), targets, reduction="none").view(n, b, s)


@dataclass
class _Family:
    """The groups that move the same weights, sampled together: ``members [n]``, their indices ``g · chains + c``
    (every chain of each group); ``weights``, the names they move, each a leaf ``[n, ...]`` (copies of ``w*``)
    that carries their gradients; ``start``, the first layer whose weights move (-1: an embedding moves;
    ``n_layers``: only the final norm or the unembedding): the stream entering it is ``w*``'s for all of them."""

    members: Tensor
    weights: dict[str, Tensor]
    start: int


def _families(model: AttentionOnlyTransformer, masks: Sequence[ParamMasks], chains: int) -> list[_Family]:
    """Members ``g · chains + c`` split by the weights their group moves (the names of its ``param_masks``)."""
    single = dict(model.named_parameters())
    groups: dict[frozenset[str], list[int]] = {}
    for g, group in enumerate(masks):
        unknown = set(group) - set(single)
        if unknown:
            raise ValueError(f"param_masks name weights the model does not have: {sorted(unknown)}")
        groups.setdefault(frozenset(group), []).append(g)
    families = []
    device = next(model.parameters()).device
    for names, indices in groups.items():
        members = torch.tensor([g * chains + c for g in indices for c in range(chains)], device=device)
        weights = {
            name: p.detach().expand(len(members), *p.shape).clone().requires_grad_()
            for name, p in model.named_parameters()
            if name in names
        }
        families.append(_Family(members, weights, _first_layer(model.shape, names)))
    return families


def _first_layer(shape: TransformerShape, moving: Collection[str]) -> int:
    """The first layer whose weights are among ``moving`` (-1 when an embedding is; ``n_layers`` when none is)."""
    if {"W_E", "W_pos"} & set(moving):
        return -1
    return min((int(name.split(".")[1]) for name in moving if name.startswith("layers.")), default=shape.n_layers)


def _reference_pass(
    model: AttentionOnlyTransformer, single: dict[str, Tensor], batches: Sequence[Tensor], starts: Collection[int]
) -> tuple[Tensor, list[dict[int, Tensor]]]:
    """One pass of ``w*`` over each batch: ``L_j(w*) [batches]`` (as :func:`_token_losses` reduces them) and
    the stream ``[1, b, t, d]`` entering each layer of ``starts`` (``n_layers``: the final stream), per batch."""
    losses, prefixes = [], []
    with torch.no_grad():
        for tokens in batches:
            x, prefix = _embed(model, single, tokens), {}
            for layer in range(model.shape.n_layers):
                if layer in starts:
                    prefix[layer] = x
                x = _layer(model, single, layer, x, tokens)
            prefix[model.shape.n_layers] = x
            losses.append(_token_losses(_unembed(model, single, x), tokens).mean())
            prefixes.append(prefix)
    return torch.stack(losses), prefixes


def _family_logits(
    model: AttentionOnlyTransformer, family: _Family, prefix: dict[int, Tensor], tokens: Tensor
) -> Tensor:
    """Logits ``[n, b, t, v]`` of the family's members on ``tokens [b, t]``: ``w*``'s stream ``prefix[start]``
    (or the members' embedding) through the layers from ``start`` on, with the members' own moving weights."""
    weights = {**{name: p.detach() for name, p in model.named_parameters()}, **family.weights}
    start = family.start
    x = _embed(model, weights, tokens) if start < 0 else prefix[start]
    for layer in range(max(start, 0), model.shape.n_layers):
        x = _layer(model, weights, layer, x, tokens)
    logits = _unembed(model, weights, x)
    return logits.expand(len(family.members), -1, -1, -1)


def _embed(model: AttentionOnlyTransformer, weights: dict[str, Tensor], tokens: Tensor) -> Tensor:
    """The stream entering the first layer, ``[m, b, t, d]`` (m = 1 while the embeddings are ``w*``'s)."""
    x = forward.embed(weights, tokens, model.shape)
    return x[None] if x.dim() == 3 else x


def _layer(model: AttentionOnlyTransformer, weights: dict[str, Tensor], layer: int, x: Tensor, tokens: Tensor):
    """``x [m, b, t, d]`` through attention layer ``layer``, with the single model's interventions there (every
    member's) -> ``[m', b, t, d]``."""
    pos = forward.layer_positions(weights, x.shape[-2], model.shape)
    changes = (model.layers[layer].changes,)
    return forward.attention_layer(weights, f"layers.{layer}.", x, model.shape.normalization, pos, changes, tokens)


def _unembed(model: AttentionOnlyTransformer, weights: dict[str, Tensor], x: Tensor) -> Tensor:
    """The stream ``x [m, b, t, d]`` -> logits ``[m', b, t - 1, v]`` of every position that has a next token."""
    return forward.unembed(weights, x[:, :, :-1], model.shape)


@dataclass
class _Weight:
    """One family's moving weight ``value [members, ...]``, its centre ``w* [...]``, the members' masks
    (broadcastable to ``value``; None: all ones), and where each member's noise comes from: ``sources[i] = (stream,
    k)``, the k-th draw of a stream, and ``source_of [members]``, an index into ``sources``."""

    value: Tensor
    center: Tensor
    mask: Tensor | None
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
            # no gradient (a head whose output an intervention replaces): zero, as devinterp's SGLD takes it
            d_p = p.grad.mul(settings.n_beta) if p.grad is not None else torch.zeros_like(p)
            if settings.localization:
                d_p.add_(settings.localization * (p - w.center))
            p.add_(d_p if w.mask is None else w.mask * d_p, alpha=-0.5 * settings.lr)
            noise = torch.stack([drawn[stream][k] for stream, k in w.sources])[w.source_of]
            p.add_(noise if w.mask is None else w.mask * noise, alpha=settings.lr**0.5)
            p.grad = None


def _update_plan(
    model: AttentionOnlyTransformer,
    families: Sequence[_Family],
    masks: Sequence[ParamMasks],
    chains: int,
    seed: int,
) -> _UpdatePlan:
    """Masks, centres and noise sources of every family's moving weights, for members ``(group g, chain c)``
    at ``g · chains + c``. devinterp draws, for each parameter of a group's ``param_masks`` in order, a normal
    of the parameter's whole shape from the generator seeded ``seed + c``: members whose (seed, shapes) agree
    share one stream, whichever family they are in."""
    single = dict(model.named_parameters())
    streams: dict[tuple, int] = {}
    generators: list[tuple[torch.Generator, list[torch.Size]]] = []
    place: dict[tuple[int, str], tuple[int, int]] = {}  # (member, parameter) -> (stream, k)
    device = next(model.parameters()).device
    for g, group in enumerate(masks):
        sizes = [single[name].shape for name in group]
        for c in range(chains):
            key = (seed + c, tuple(sizes))
            if key not in streams:
                streams[key] = len(generators)
                generators.append((torch.Generator(device=device).manual_seed(seed + c), sizes))
            for k, name in enumerate(group):
                place[g * chains + c, name] = (streams[key], k)
    weights = []
    for family in families:
        members = family.members.tolist()
        for name, value in family.weights.items():
            mask = torch.zeros_like(value, requires_grad=False)
            for i, m in enumerate(members):
                given = masks[m // chains][name]
                mask[i] = 1.0 if given is None else given.to(mask)
            sources = list(dict.fromkeys(place[m, name] for m in members))
            source_of = torch.tensor([sources.index(place[m, name]) for m in members], device=device)
            mask = None if bool(mask.all()) else _compact(mask)
            weights.append(_Weight(value, single[name].detach(), mask, sources, source_of))
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
