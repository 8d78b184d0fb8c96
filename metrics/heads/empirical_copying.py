"""Empirical copying scores of each head on the probe batch (Olsson et al. 2022, "In-context
Learning and Induction Heads"; docs/measures.md "Copying score, empirical"; seed 004).

At each query position, push the head's write to the residual stream through the unembedding
(direct path, final-norm gain folded in), subtract the mean logit over the vocabulary and keep the
positive part: the logits the head raises. Two readings of that raise:

- ``score`` (docs/measures.md): the share ``s`` in [0, 1] of the raise that lands on the token the head
  attends to most, rescaled to ``2 s - 1`` in [-1, 1]. With a large vocabulary about half the
  centred logits are positive, so even a head that raises the attended token most shares it with
  the many small raises: a trained induction head over 256 tokens scores near -0.96.
- ``top_rate`` (seed 004, "how often a token increases its own probability more than any other
  token"): the fraction of positions where the attended token gets the largest raise, in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class EmpiricalCopying:
    """Per head ``[n_layers, n_heads]``, means over the batch and the scored query positions."""

    score: Tensor  # 2 s - 1, in [-1, 1]
    top_rate: Tensor  # in [0, 1]


def empirical_copying(
    head_out: Tensor, pattern: Tensor, tokens: Tensor, unembedding: Tensor, first_query: int = 1
) -> EmpiricalCopying:
    """Both scores over the query positions ``>= first_query``.

    ``head_out [L, b, h, t, d_model]`` (each head's write), ``pattern [L, b, h, t, t]``,
    ``tokens [b, t]``, ``unembedding [d_model, d_vocab]``. Computed in ``head_out``'s dtype: the
    largest product the tracker makes, and a share needs no float64.
    """
    raised = head_out[..., first_query:, :] @ unembedding.to(head_out)  # (L, b, h, t', v)
    raised = (raised - raised.mean(-1, keepdim=True)).relu()
    L, b, h = pattern.shape[:3]
    key_tokens = tokens.to(pattern.device)[None, :, None, :].expand(L, b, h, tokens.shape[-1])
    attended = key_tokens.gather(-1, pattern[..., first_query:, :].argmax(-1))  # (L, b, h, t'): token at the top key
    on_attended = raised.gather(-1, attended[..., None]).squeeze(-1)  # (L, b, h, t')
    share = on_attended / raised.sum(-1).clamp_min(torch.finfo(raised.dtype).tiny)
    top = (on_attended > 0) & (on_attended >= raised.max(-1).values)
    return EmpiricalCopying(score=(2 * share - 1).mean(dim=(1, 3)), top_rate=top.to(raised.dtype).mean(dim=(1, 3)))
