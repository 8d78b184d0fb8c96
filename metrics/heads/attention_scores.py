"""Attention-pattern head scores on the probe batch (Olsson et al. 2022, "In-context Learning and
Induction Heads"; docs/measures.md).

The probe is ``[BOS], t_1 .. t_n, (gap), t_1 .. t_n``: the second copy starts at ``repeat_start`` and
each of its tokens first occurred exactly ``period`` positions earlier (``n`` without a gap). Patterns are ``[batch, heads, query,
key]``, optionally with leading dims (e.g. layers stacked: ``[layers, batch, heads, query, key]``);
each score is ``[..., heads]``, the mean over the batch and the scored query positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from data.probe import ProbeBatch


def mean_attention_at_offset(pattern: Tensor, queries: Tensor, offset: int) -> Tensor:
    """Mean of ``pattern[..., b, h, q, q - offset]`` over the batch and queries ``q`` -> ``[..., heads]``."""
    return pattern[..., queries, queries - offset].mean(dim=-1).mean(dim=-2)


def previous_token_score(pattern: Tensor) -> Tensor:
    """Mean attention from each position ``i >= 1`` to ``i - 1``."""
    queries = torch.arange(1, pattern.shape[-1], device=pattern.device)
    return mean_attention_at_offset(pattern, queries, 1)


def repeat_queries(pattern: Tensor, probe: ProbeBatch) -> Tensor:
    """The second copy's positions ``[n]``."""
    return torch.arange(probe.repeat_start, probe.repeat_start + probe.n, device=pattern.device)


def induction_score(pattern: Tensor, probe: ProbeBatch) -> Tensor:
    """Mean attention from each repeated token to the token that *followed* its first occurrence
    (prefix matching), i.e. offset ``period - 1``."""
    return mean_attention_at_offset(pattern, repeat_queries(pattern, probe), probe.period - 1)


def duplicate_token_score(pattern: Tensor, probe: ProbeBatch) -> Tensor:
    """Mean attention from each repeated token to its first occurrence, offset ``period``."""
    return mean_attention_at_offset(pattern, repeat_queries(pattern, probe), probe.period)
