"""Causal attention: the one place its scores and softmax are written (the model's explicit path,
its interventions, and every metric that recomputes a pattern: the ablation ground truth)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_scores(q: Tensor, k: Tensor) -> Tensor:
    """``q kᵀ / sqrt(d_head)``: ``[..., s, e] x [..., t, e] -> [..., s, t]``."""
    return (q @ k.mT).div_(math.sqrt(q.shape[-1]))


def causal_softmax(scores: Tensor, first_query: int = 0) -> Tensor:
    """The attention pattern of ``scores [..., s, t]`` whose rows are the queries at positions
    ``first_query, first_query + 1, ...`` over keys at ``0 .. t-1``: each row's later keys masked,
    then softmax. Masks ``scores`` in place."""
    future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(first_query + 1)
    return scores.masked_fill_(future, float("-inf")).softmax(dim=-1)


def fused_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The mixed values ``z [..., t, e]`` of causal attention of ``q, k, v [..., t, e]`` by PyTorch's
    fused kernel (no pattern kept): the training path's, for code that needs only ``z``."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def random_patterns(
    shape: tuple[int, ...], logit_std: float, generator: torch.Generator, dtype: torch.dtype, device
) -> Tensor:
    """Causal attention patterns ``[*shape, s, s]`` (``shape`` ends with ``s, s``) of i.i.d.
    N(0, ``logit_std``²) logits: a head that has learnt nothing (the null of
    :func:`metrics.heads.behaviour.null_from_random_patterns`)."""
    logits = torch.randn(shape, generator=generator, dtype=dtype, device=device) * logit_std
    return causal_softmax(logits)


def causal_pattern(q: Tensor, k: Tensor, first_query: int = 0) -> Tensor:
    """Causal attention of queries ``q [..., s, e]`` at positions ``first_query ..`` over keys
    ``k [..., t, e]``: ``softmax(q kᵀ / sqrt(d_head))`` under the causal mask, ``[..., s, t]``."""
    return causal_softmax(attention_scores(q, k), first_query)
