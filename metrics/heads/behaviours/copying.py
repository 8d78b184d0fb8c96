"""Copying heads, read from what a head writes: Olsson et al. 2022's copying evaluator on the probe, the
head's direct effect on the logits (docs/measures.md, "Head and circuit scores").

``score``: Olsson et al. 2022's copying evaluator ("In-context Learning and Induction Heads",
Transformer Circuits Thread, section "Head activation evaluators",
https://transformer-circuits.pub/2022/in-context-learning-and-induction-heads/index.html):

    "Compute this head's contribution to the residual stream, then convert that using the
    unembeddings (i.e. along the "direct path") to impacts on each logit. Logits are transformed
    by subtracting the mean of the logits and passing through a ReLU, allowing the evaluator to
    focus on where logits are raised. Compute the ratio of the amount it raises the logits of the
    token being attended to, to that of all tokens in this sample. This value ranges from 0 (only
    raises other tokens) to 0.5 (only raises the present token), so we scale it into the range of
    -1 to 1."

Per head, sequence ``b`` and query position ``q >= first_query``, with ``o`` the head's write at
``q`` and ``W_U`` the unembedding (the final norm folded in by the caller, ``folded_unembedding``)::

    raise = ReLU(o W_U - mean_v(o W_U))                  # [d_vocab], the logits the head raises
    tau   = tokens[b, argmax_k pattern[q, k]]            # the token being attended to
    S_b   = the distinct token ids in sequence b         # "all tokens in this sample"
    r     = raise[tau] / sum_{t in S_b} raise[t]         # in [0, 1]; 0 when the sum is 0
    score = mean over b and q of (2 r - 1)               # in [-1, 1]

- A copying head (its write raises the attended token and no other token of the sequence) reads
  +1; an anti-copying head (it lowers the attended token, so after centring the other tokens are
  the raised ones) reads -1.
- A head whose raises are exchangeable across the sequence's tokens (a random head) has
  E[r] = 1 / |S_b|: it reads about ``2 / |S_b| - 1`` (-0.88 on a probe of 16 distinct random
  tokens and BOS), near the bottom, because raising the attended token by chance is rare.

Readings of the paper's text, stated because it leaves them open:

- The denominator sums the raise over the token ids present in the sequence (each id once,
  BOS included), not over the vocabulary. Summing over the whole vocabulary counts the small raises
  of ~half of all tokens and scores a working induction head near -1 over 256 tokens.
- "The token being attended to" is the token at the key with the largest attention weight (first
  such key on ties).
- The ratio as defined reaches 1, not 0.5, when only the attended token is raised (the attended
  token is one of the sample's tokens); the paper's two end points, "only raises other tokens" and
  "only raises the present token", are mapped to -1 and +1 by ``2 r - 1``.
- Inputs: the paper scores 10 sequences of 25 random tokens (no repeat, no BOS, its footnote 31),
  excluding the most and least common tokens. The tracker passes its probe batch (BOS, ``n``
  uniform random tokens, the same ``n`` again) and scores every query after BOS: the first copy is
  the paper's setting, the repeat adds the positions where an induction head attends to the token
  it should copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from metrics.heads.behaviours.base import Behaviour, HeadWrites
from metrics.heads.circuit_scores import folded_unembedding


def copying_evaluator(
    head_out: Tensor, pattern: Tensor, tokens: Tensor, unembedding: Tensor, first_query: int = 1
) -> Tensor:
    """The module docstring's score of every head, over the query positions ``>= first_query``:
    ``head_out [L, b, h, t, d_model]`` (each head's write), ``pattern [L, b, h, t, t]``, ``tokens [b, t]``,
    ``unembedding [d_model, d_vocab]`` -> ``[L, h]``, the mean over the batch and the scored queries.
    Computed in ``head_out``'s dtype: the largest product the tracker makes, and a ratio needs no float64."""
    unembedding = unembedding.to(head_out)
    centred = unembedding - unembedding.mean(-1, keepdim=True)  # o W_U - mean_v(o W_U) = o (W_U - mean_v W_U)
    logits = head_out[..., first_query:, :] @ centred  # (L, b, h, t', v): the raise before its ReLU
    L, b, h, queries = logits.shape[:4]
    tokens = tokens.to(pattern.device)
    keys = tokens.shape[-1]
    # the raise is only read on the sample's own ids
    on_keys = logits.gather(
        -1, tokens[None, :, None, None, :].expand(L, b, h, queries, keys)
    ).relu_()  # (L, b, h, t', t)
    repeats = (tokens[:, :, None] == tokens[:, None, :]).tril(-1).any(-1)  # (b, t): the id already occurs earlier
    on_sample = on_keys.masked_fill(repeats[None, :, None, None, :], 0.0).sum(-1)  # (L, b, h, t'): over distinct ids
    top_key = pattern[..., first_query:, :].argmax(-1)  # (L, b, h, t'): the key attended to most
    on_attended = on_keys.gather(-1, top_key[..., None]).squeeze(-1)  # (L, b, h, t'): the attended token's raise
    tiny = torch.finfo(logits.dtype).tiny
    ratio = torch.where(on_sample > 0, on_attended / on_sample.clamp_min(tiny), 0.0).clamp(max=1.0)
    return (2 * ratio - 1).mean(dim=(1, 3))


class Copying(Behaviour):
    """Olsson et al. 2022's copying evaluator (the module docstring): +1 where a head's write raises the token
    it attends to and no other token of the sequence."""

    name = "copying"
    colour = "tab:cyan"
    reads = "writes"

    @staticmethod
    def score(writes: HeadWrites) -> Tensor:
        unembedding = folded_unembedding(writes.model)
        return copying_evaluator(writes.head_out, writes.patterns, writes.tokens, unembedding, writes.first_query)
