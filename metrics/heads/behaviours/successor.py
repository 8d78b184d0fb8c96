"""Successor heads, read from what a head writes: Gould, Ong, Ogden & Conmy 2023 ("Successor Heads:
Recurring, Interpretable Attention Heads In The Wild", arXiv 2312.09230) find heads whose OV circuit maps a
token of an ordinal sequence (1, 2, 3; Monday, Tuesday; A, B) to its successor, and score a head by how
often the successor is the top logit its OV circuit gives among the sequence's tokens. Here the ordinal
sequence is the vocabulary's own order: the task's token ids ``0 .. n_random - 1`` (BOS left out), the
successor of ``t`` being ``t + 1``. Per head, with the full OV circuit
``M = W_E W_V W_O W_U [n_random, n_random]`` (norms folded in, as the copying scores fold them)::

    score = mean over t = 0 .. n_random - 2 of [ argmax_j M[t, j] == t + 1 ]    # in [0, 1]

A head that writes its input's successor reads 1; a copying head (argmax on the diagonal) 0; a random
head about ``1 / n_random``. Read from the weights alone; on a task whose ids carry no order it says
whether a head learnt one anyway (a control: none should)."""

from __future__ import annotations

import torch
from torch import Tensor

from metrics.composition.circuits import centre_writing
from metrics.heads.behaviours.base import Behaviour, HeadWrites
from metrics.heads.circuit_scores import folded_unembedding


def successor_scores(model, circuits, n_random: int) -> Tensor:
    """The module docstring's score of every head: ``[n_layers, n_heads]``, from the OV circuits' low-rank
    factors (``circuits.ov``: ``W_V`` folded ``[L, H, d, r]``, ``W_Oᵀ`` ``[L, H, d, r]``)."""
    dtype = circuits.ov.left.dtype
    tokens = centre_writing(model.final_norm, model.W_E, dtype)[:n_random]  # (n, d): the ordinal tokens' rows
    unembedding = folded_unembedding(model, dtype)[:, :n_random]  # (d, n)
    reads = tokens @ circuits.ov.left  # (L, H, n, r) = W_E W_V
    writes = circuits.ov.right.mT @ unembedding  # (L, H, r, n) = W_O W_U
    top = (reads @ writes)[..., :-1, :].argmax(-1)  # (L, H, n - 1): each token's top logit
    successors = torch.arange(1, n_random, device=top.device)
    return (top == successors).to(dtype).mean(-1)


class Successor(Behaviour):
    """How often a head's OV circuit makes ``t + 1`` the top logit of token ``t`` (the module docstring)."""

    name = "successor"
    colour = "tab:green"
    reads = "writes"

    @staticmethod
    def score(writes: HeadWrites) -> Tensor:
        return successor_scores(writes.model, writes.circuits, writes.n_random)
