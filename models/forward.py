"""The attention-only forward pass, written once, for weights that may carry a leading member axis.

Every model of the project runs through these functions: the single model
(:class:`~models.transformer.AttentionOnlyTransformer`), an ensemble's stacked members
(:class:`~models.ensemble_transformer.EnsembleTransformer`), and the refined LLC's members, which move some weights and
share the rest (:mod:`metrics.dynamics.refined_llc`). A change to attention (a position scheme, a
normalization, an intervention) is made here and reaches all three.

Weights are named as the single model's parameters (``W_E``, ``layers.0.W_Q``, ``layers.0.norm.weight``,
``final_norm.weight``, ``W_U``, ...; see :meth:`~models.transformer.AttentionOnlyTransformer.named_parameters`).
Each is either the single model's ``[...]``, shared by every member, or the members' own ``[n, ...]``. A
stream is ``x [m, b, t, d_model]``: ``m`` is 1 while every weight it went through was shared, ``n`` after
the first of the members' own. Each projection is one GEMM that broadcasts over the member axis (one ``mm``
over every token for a shared weight, one ``bmm`` for the members'), and attention is one fused
``scaled_dot_product_attention`` over ``m x b`` sequences, or explicit patterns member by member where a
member's heads are intervened on (:func:`~models.interventions.attend`).

Row vectors, as TransformerLens (docs/measures.md): a head reads ``x @ W_Q[h]`` and writes ``z @ W_O[h]``;
Elhage et al. 2021's attention-only transformer, with no MLPs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from models.attention import fused_causal_attention
from models.interventions import HeadChange, attend


class Shape(Protocol):
    """What the pass reads of a model's shape (:class:`models.transformer.TransformerShape`)."""

    n_layers: int
    n_ctx: int
    normalization: str
    positions: str


Weights = Mapping[str, Tensor]
"""Every weight of a model by its single-model parameter name, each ``[...]`` (shared) or ``[n, ...]``."""

MemberChanges = Sequence[Sequence[HeadChange]]
"""One layer's interventions: one sequence of head changes per member, or a single one every member shares."""

NO_CHANGES: MemberChanges = ((),)


def normalize(x: Tensor, normalization: str, gain: Tensor | None) -> Tensor:
    """A pre-attention (or final) normalization of ``x [..., d]`` with no bias: LayerNorm or RMSNorm with
    ``gain [d]`` (fused, as ``nn.LayerNorm`` / ``nn.RMSNorm`` compute it), or with each member's ``gain [n, d]``
    on ``x [m, b, t, d]``; ``x`` itself without a gain (no normalization)."""
    if gain is None:
        return x
    d = x.shape[-1]
    layer_norm = normalization == "layernorm"
    if gain.dim() == 1:
        return F.layer_norm(x, (d,), gain) if layer_norm else F.rms_norm(x, (d,), gain)
    normed = F.layer_norm(x, (d,)) if layer_norm else F.rms_norm(x, (d,))
    return normed * gain.view(-1, 1, 1, d)


def project(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Per-head reads of the stream: ``x [..., t, d]`` by a shared ``weight [h, d, e]`` (one ``d x h·e`` GEMM over
    every leading index: a broadcast ``[..., 1, t, d] @ [h, d, e]`` would copy the weights once per index), or
    ``x [m, b, t, d]`` by the members' ``weight [n, h, d, e]`` (one batched GEMM; ``m = 1`` is shared by all);
    plus ``bias [(n,) h, e]`` -> ``[..., h, t, e]``."""
    h, d, e = weight.shape[-3:]
    matrix = weight.transpose(-3, -2).reshape(*weight.shape[:-3], d, h * e)  # (n?, d, h·e)
    if weight.dim() == 3:
        out = x @ matrix
    else:
        m, b, t, _ = x.shape
        out = (x.reshape(m, b * t, d) @ matrix).view(-1, b, t, h * e)
    out = out.unflatten(-1, (h, e)).transpose(-3, -2)  # (..., h, t, e)
    if bias is None:
        return out
    return out + (bias[:, None] if bias.dim() == 2 else bias.view(-1, 1, h, 1, e))


def mix(q: Tensor, k: Tensor, v: Tensor, changes: MemberChanges = NO_CHANGES, tokens: Tensor | None = None) -> Tensor:
    """Causal attention of ``q, k, v [m, b, h, t, e]`` (a leading 1 broadcasts) -> the mixed values
    ``z [m, b, h, t, e]``. ``changes``: each member's interventions (one sequence: every member's); a member
    with some goes through explicit patterns, :func:`~models.interventions.attend`, the rest through the fused
    kernel. ``tokens [b, t]`` or each member's ``[m, b, t]``: what a clamp's target reads."""
    m = max(q.shape[0], k.shape[0], v.shape[0])
    q, k, v = (a.expand(m, *a.shape[1:]) for a in (q, k, v))
    _, b, h, t, e = q.shape
    if not any(changes):
        return fused_causal_attention(*(a.reshape(m * b, h, t, e) for a in (q, k, v))).view(m, b, h, t, e)
    if len(changes) not in (1, m):
        raise ValueError(f"{len(changes)} members' interventions for {m} members")
    each = changes if len(changes) == m else [changes[0]] * m
    z = []
    for i, member_changes in enumerate(each):
        member_tokens = tokens if tokens is None or tokens.dim() == 2 else tokens[i]
        if member_changes:
            z.append(attend(q[i], k[i], v[i], member_changes, member_tokens)[1])
        else:
            z.append(fused_causal_attention(q[i], k[i], v[i]))
    return torch.stack(z)


def write(z: Tensor, W_O: Tensor, b_O: Tensor | None = None) -> Tensor:
    """Every head's output into the stream: ``z [..., h, t, e]`` by a shared ``W_O [h, e, d]``, or
    ``z [m, b, h, t, e]`` by the members' ``W_O [n, h, e, d]`` -> ``[..., t, d]`` (one GEMM over ``(head,
    d_head)``), plus the layer's ``b_O [(n,) d]``."""
    h, e, d = W_O.shape[-3:]
    flat = z.transpose(-3, -2).flatten(-2)  # (..., t, h·e)
    matrix = W_O.reshape(*W_O.shape[:-3], h * e, d)
    if W_O.dim() == 3:
        out = flat @ matrix
    else:
        m, b, t, _ = flat.shape
        out = (flat.reshape(m, b * t, h * e) @ matrix).view(-1, b, t, d)
    if b_O is None:
        return out
    return out + (b_O if b_O.dim() == 1 else b_O.view(-1, 1, 1, d))


def positions(weights: Weights, t: int) -> Tensor:
    """The first ``t`` learned positions: ``[t, d]`` shared, ``[n, 1, t, d]`` the members' own (each broadcasts
    against a stream ``[..., t, d]`` / ``[m, b, t, d]``)."""
    W_pos = weights["W_pos"][..., :t, :]
    return W_pos if W_pos.dim() == 2 else W_pos[:, None]


def embed(weights: Weights, tokens: Tensor, shape: Shape) -> Tensor:
    """The stream entering the first layer: the token embeddings of ``tokens [..., t]`` plus the positions,
    unless ``shape.positions`` is ``shortformer`` (Press et al. 2021: the positions reach only the queries'
    and keys' inputs, :func:`attention_layer`). ``[..., t, d]`` by a shared ``W_E``; by the members' ``W_E
    [n, v, d]``, ``[n, b, t, d]`` of ``tokens [b, t]`` (every member reads them) or ``[n, b, t]`` (each its own)."""
    W_E, t = weights["W_E"], tokens.shape[-1]
    if t > shape.n_ctx:
        raise ValueError(f"sequence length {t} exceeds n_ctx={shape.n_ctx}")
    if W_E.dim() == 2:
        x = W_E[tokens]
    elif tokens.dim() == 2:
        x = W_E[:, tokens]
    else:
        members = torch.arange(W_E.shape[0], device=tokens.device)[:, None, None]
        x = W_E[members, tokens]
    return x if shape.positions == "shortformer" else x + positions(weights, t)


def attention_layer(
    weights: Weights,
    prefix: str,
    x: Tensor,
    normalization: str,
    pos: Tensor | None = None,
    changes: MemberChanges = NO_CHANGES,
    tokens: Tensor | None = None,
) -> Tensor:
    """The stream ``x [m, b, t, d]`` through one attention layer, whose weights are named ``prefix + "W_Q"``
    (``layers.0.``; empty for a layer's own parameters) -> ``[m', b, t, d]``: the normalized input (plus
    ``pos``, shortformer positions from :func:`positions`, for the queries and keys alone) read by every head,
    causal attention (:func:`mix`, with ``changes``), every head's write added to the stream.

    Each of the three reads normalizes the stream itself, so the backward pass sums three norm gradients into
    the stream (one shared norm would sum the reads' gradients first: the same to rounding, not to the bit);
    without a normalization the reads are one and the same."""
    gain = weights.get(prefix + "norm.weight")

    def read(with_positions: bool) -> Tensor:
        normed = normalize(x, normalization, gain)
        return normed + pos if with_positions and pos is not None else normed

    q = project(read(True), weights[prefix + "W_Q"], weights.get(prefix + "b_Q"))  # (m, b, h, t, e)
    k = project(read(True), weights[prefix + "W_K"], weights.get(prefix + "b_K"))
    v = project(read(False), weights[prefix + "W_V"], weights.get(prefix + "b_V"))
    z = mix(q, k, v, changes, tokens)
    return x + write(z, weights[prefix + "W_O"], weights.get(prefix + "b_O"))


def layer_positions(weights: Weights, t: int, shape: Shape) -> Tensor | None:
    """What every layer's queries and keys add to their input: the first ``t`` positions under shortformer
    positions, else None (they are in the stream already)."""
    return positions(weights, t) if shape.positions == "shortformer" else None


def unembed(weights: Weights, x: Tensor, shape: Shape) -> Tensor:
    """The final stream ``x [..., t, d]`` (``[m, b, t, d]`` with the members' ``W_U``) -> logits ``[..., t, d_vocab]``
    (the final normalization, ``W_U`` and ``b_U``)."""
    x = normalize(x, shape.normalization, weights.get("final_norm.weight"))
    W_U, b_U = weights["W_U"], weights.get("b_U")
    if W_U.dim() == 2:
        logits = x @ W_U
    else:
        m, b, t, d = x.shape
        logits = (x.reshape(m, b * t, d) @ W_U).view(-1, b, t, W_U.shape[-1])
    if b_U is None:
        return logits
    return logits + (b_U if b_U.dim() == 1 else b_U.view(-1, 1, 1, b_U.shape[-1]))


def logits(weights: Weights, tokens: Tensor, shape: Shape, changes: Sequence[MemberChanges] | None = None) -> Tensor:
    """Logits ``[m, b, t, d_vocab]`` of ``tokens [b, t]`` (every member reads them) or ``[n, b, t]`` (each its
    own); ``changes[l]``: layer ``l``'s interventions (:data:`MemberChanges`; None: none anywhere)."""
    x = embed(weights, tokens, shape)
    x = x[None] if x.dim() == 3 else x  # (m, b, t, d)
    pos = layer_positions(weights, tokens.shape[-1], shape)
    for layer in range(shape.n_layers):
        layer_changes = NO_CHANGES if changes is None else changes[layer]
        x = attention_layer(weights, f"layers.{layer}.", x, shape.normalization, pos, layer_changes, tokens)
    return unembed(weights, x, shape)
