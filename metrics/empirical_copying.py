"""Empirical copying score of each head on the probe batch (Olsson et al. 2022, "In-context
Learning and Induction Heads"; MEASURES.md "Copying score, empirical").

At each query position, push the head's write to the residual stream through the unembedding
(direct path, final-norm gain folded in), subtract the mean logit over the vocabulary and keep the
positive part: the logits the head raises. The share of that raise which lands on the token the
head attends to most, ``s`` in [0, 1], is rescaled to ``2 s - 1`` in [-1, 1]: 1 for a head that
raises only the token it attends to, -1 for one that raises anything but it (or nothing at all).
"""

from __future__ import annotations

import torch
from torch import Tensor


def empirical_copying_scores(
    head_out: Tensor, pattern: Tensor, tokens: Tensor, unembedding: Tensor, first_query: int = 1
) -> Tensor:
    """Mean ``2 s - 1`` over the batch and query positions ``>= first_query`` -> ``[n_layers, n_heads]``.

    ``head_out [L, b, h, t, d_model]`` (each head's write), ``pattern [L, b, h, t, t]``,
    ``tokens [b, t]``, ``unembedding [d_model, d_vocab]``. Computed in ``head_out``'s dtype: the
    largest product the tracker makes, and a share needs no float64.
    """
    raised = head_out @ unembedding.to(head_out)  # (L, b, h, t, v)
    raised = (raised - raised.mean(-1, keepdim=True)).relu()
    L, b, h, t = pattern.shape[:4]
    key_tokens = tokens.to(pattern.device)[None, :, None, :].expand(L, b, h, t)
    attended = key_tokens.gather(-1, pattern.argmax(-1))  # (L, b, h, t): token at the top key
    on_attended = raised.gather(-1, attended.to(raised.device)[..., None]).squeeze(-1)  # (L, b, h, t)
    share = on_attended / raised.sum(-1).clamp_min(torch.finfo(raised.dtype).tiny)
    return (2 * share[..., first_query:] - 1).mean(dim=(1, 3))
