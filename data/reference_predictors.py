"""Reference predictors: next-token distributions computable from the context alone, the strategies a
model can be compared with (Edelman et al. 2024, "The Evolution of Statistical Induction Heads:
In-Context Learning Markov Chains": uniform, then in-context unigram, then in-context bigram).

Every function takes token ids ``tokens [b, t]`` and gives ``[b, t, n_random]``: entry ``[i, j]`` is
the strategy's distribution of token ``j + 1`` given tokens ``0 .. j`` (the model's logits at
position ``j`` predict the same token). BOS and every id ``>= n_random`` count as context but are never
predicted. Written by hand: no library computes in-context n-gram predictors over a batch.

A task names its strategies, and the truth where it is known, in :meth:`data.task.Task.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

HELD_OUT_STRATEGY_IDS = 2 * 10**12
"""First sample id of the sequences the strategies are scored on: the training stream draws ids from
0 up and the LLC's held-out sequences from 10**12 (``conf.objects.HELD_OUT_IDS``), so these are
fresh sequences of the training distribution that neither saw."""


@dataclass(frozen=True)
class ReferencePredictions:
    """Held-out sequences and what each strategy (and the truth, where known) predicts on them.

    ``tokens [b, t]``; ``positions [p]``: the positions read (indices into the model's ``[b, t, V]``
    logits); ``strategies``: name -> ``[b, p, n_random]`` distributions, in the order the task names
    them (simplest first); ``truth``: ``[b, p, n_random]``, the distribution the data was drawn from,
    or None where the task has no closed form for it; ``scored``: ``[b, p]`` booleans, which of the
    positions count in each sequence where that differs from sequence to sequence (a task whose
    predictable stretches sit at random places), or None: every position of every sequence."""

    tokens: Tensor
    positions: Tensor
    strategies: dict[str, Tensor]
    truth: Tensor | None = None
    scored: Tensor | None = None

    def __post_init__(self) -> None:
        shapes = {tuple(q.shape) for q in self.strategies.values()}
        if self.truth is not None:
            shapes.add(tuple(self.truth.shape))
        if len(shapes) != 1:
            raise ValueError(f"strategies and truth must share one shape [b, p, n_random], got {sorted(shapes)}")
        if self.scored is not None:
            if self.scored.dtype != torch.bool or tuple(self.scored.shape) != next(iter(shapes))[:2]:
                raise ValueError(
                    f"scored must be booleans [b, p] = {list(next(iter(shapes))[:2])},"
                    f" got {self.scored.dtype} {list(self.scored.shape)}"
                )
            if not self.scored.any(1).all():
                raise ValueError("every sequence needs a scored position (its KLs are means over them)")


def counts_so_far(tokens: Tensor, n_random: int) -> Tensor:
    """``[b, t, n_random]``: how often each task token occurs in tokens ``0 .. j`` (BOS not counted)."""
    return F.one_hot(tokens.clamp(max=n_random), n_random + 1)[..., :n_random].cumsum(1).double()


def uniform(tokens: Tensor, n_random: int) -> Tensor:
    """Every task token equally likely: ``1 / n_random``."""
    return torch.full((*tokens.shape, n_random), 1.0 / n_random, dtype=torch.float64, device="cpu")


def unigram(tokens: Tensor, n_random: int, add: float = 1.0) -> Tensor:
    """In-context unigram with add-``add`` counts: ``(count of v in tokens 0..j + add) / (j' + n_random·add)``
    (Laplace's rule of succession; Edelman et al.'s ``ngram(·, n=1)``)."""
    counts = counts_so_far(tokens, n_random) + add
    return counts / counts.sum(-1, keepdim=True)


def ngram(tokens: Tensor, n_random: int, order: int, add: float = 1.0) -> Tensor:
    """In-context n-gram of ``order`` (1: bigram, 2: trigram) with add-``add`` counts: at position j, the
    counts of each v over the earlier places where the ``order`` tokens ending at j occurred followed by
    v (Edelman et al.'s ``ngram(·, n=order + 1)``). Positions with fewer than ``order`` tokens, or whose
    context holds a token ``>= n_random`` (BOS), have no matches: their counts are all ``add``.

    Cost ``b · t · n_random^(order + 1)`` (meant for the small alphabets of in-context chains)."""
    b, t = tokens.shape
    n_contexts = n_random**order
    context = torch.full((b, t), -1, dtype=torch.long, device="cpu")  # the id of tokens (j - order + 1 .. j), -1: none
    valid = torch.zeros(b, t, dtype=torch.bool, device="cpu")
    if t >= order:
        windows = tokens.unfold(1, order, 1)  # (b, t - order + 1, order)
        ok = (windows < n_random).all(-1)
        ids = (windows.clamp(max=n_random - 1) * (n_random ** torch.arange(order - 1, -1, -1, device="cpu"))).sum(-1)
        context[:, order - 1 :] = torch.where(ok, ids, -1)
        valid[:, order - 1 :] = ok
    # transitions (context at j, token j + 1), counted for every j + 1 <= the scored position
    follows = torch.zeros(b, t, n_contexts * n_random, dtype=torch.float64, device="cpu")
    has_next = valid[:, :-1] & (tokens[:, 1:] < n_random)
    pair = context[:, :-1].clamp(min=0) * n_random + tokens[:, 1:].clamp(max=n_random - 1)
    follows[:, 1:].scatter_(2, pair[..., None], has_next[..., None].double())
    seen = follows.cumsum(1).view(b, t, n_contexts, n_random)  # [b, t, contexts, next]
    mine = seen.gather(2, context.clamp(min=0)[:, :, None, None].expand(b, t, 1, n_random)).squeeze(2)
    counts = torch.where(valid[..., None], mine, torch.zeros_like(mine)) + add
    return counts / counts.sum(-1, keepdim=True)


def copy(tokens: Tensor, n_random: int) -> Tensor:
    """Uniform over the distinct task tokens in tokens ``0 .. j`` (the one-layer strategy of repeated
    tokens: attend to the context, copy what is there); uniform over all where there are none."""
    present = counts_so_far(tokens, n_random) > 0
    none = ~present.any(-1, keepdim=True)
    present = present | none
    return present.double() / present.sum(-1, keepdim=True)


def induction(tokens: Tensor, n_random: int, fallback: Tensor | None = None) -> Tensor:
    """All mass on the token that followed the latest earlier occurrence of token j (Olsson et al.
    2022's induction head); where token j has not occurred before (or was followed by BOS), ``fallback``
    ``[b, t, n_random]`` (default :func:`uniform`)."""
    b, t = tokens.shape
    same = tokens[:, :, None] == tokens[:, None, :]  # (b, j, i): token i equals token j
    earlier = torch.ones(t, t, dtype=torch.bool, device="cpu").tril(-1)  # i < j
    where = same & earlier & (tokens[:, None, :] < n_random)
    index = torch.arange(t, device="cpu").expand(b, t, t)
    latest = torch.where(where, index, -1).amax(-1)  # (b, t): -1 where none
    following = tokens.gather(1, (latest + 1).clamp(max=t - 1))
    found = (latest >= 0) & (following < n_random)
    delta = F.one_hot(following.clamp(max=n_random - 1), n_random).double()
    fallback = uniform(tokens, n_random) if fallback is None else fallback
    return torch.where(found[..., None], delta, fallback)


def longest_match(tokens: Tensor, n_random: int, fallback: Tensor | None = None) -> Tensor:
    """Induction on the longest match: the context's longest suffix ending at token j that occurred
    before (ending at some i < j), and the token that followed it, uniform over the followers where
    several earlier occurrences match as far back; ``fallback`` (default :func:`uniform`) where token j
    has not occurred before followed by a task token. On copied text this recalls the copy's source:
    the tokens before j agree with it as far back as the copy goes, where a chance earlier occurrence
    of token j alone (which :func:`induction` takes when it is the latest) agrees for one token."""
    b, t = tokens.shape
    same = tokens[:, :, None] == tokens[:, None, :]  # (b, j, i)
    length = torch.zeros(b, t, t, dtype=torch.long, device="cpu")  # tokens equal going back from j and i
    length[:, 0] = same[:, 0].long()
    for j in range(1, t):
        length[:, j, 1:] = same[:, j, 1:] * (1 + length[:, j - 1, :-1])
        length[:, j, 0] = same[:, j, 0].long()
    followed = torch.zeros(b, t, dtype=torch.bool, device="cpu")
    followed[:, :-1] = tokens[:, 1:] < n_random  # position i has a task token after it
    earlier = torch.ones(t, t, dtype=torch.bool, device="cpu").tril(-1)  # i < j
    length = torch.where(earlier & followed[:, None, :], length, torch.zeros_like(length))
    longest = length.amax(-1, keepdim=True)  # (b, j, 1)
    matches = ((length == longest) & (longest > 0)).double()  # (b, j, i)
    following = F.one_hot(tokens.roll(-1, 1).clamp(max=n_random - 1), n_random).double()  # (b, i, V): token i + 1
    recalled = torch.einsum("bji,biv->bjv", matches, following)
    found = longest[..., 0] > 0
    fallback = uniform(tokens, n_random) if fallback is None else fallback
    return torch.where(found[..., None], recalled / recalled.sum(-1, keepdim=True).clamp_min(1.0), fallback)


def one_and_two_layer(tokens: Tensor, n_random: int) -> dict[str, Tensor]:
    """Uniform, copy (one layer's strategy) and induction (two layers'), simplest first: the strategies
    of a task that names none of its own (:meth:`data.task.Task.reference`)."""
    return {
        "uniform": uniform(tokens, n_random),
        "copy": copy(tokens, n_random),
        "induction": induction(tokens, n_random),
    }


def scored_mean(values: Tensor, scored: Tensor | None) -> Tensor:
    """``values [b, p]`` averaged over each sequence's scored positions (``scored [b, p]``; None: all): ``[b]``."""
    if scored is None:
        return values.mean(-1)
    return torch.where(scored, values, torch.zeros_like(values)).sum(-1) / scored.sum(-1)


def at_positions(predictions: dict[str, Tensor], positions: Tensor) -> dict[str, Tensor]:
    """Each ``[b, t, V]`` cut to the scored ``positions`` ``[p]``: ``[b, p, V]``."""
    return {name: q[:, positions] for name, q in predictions.items()}


def stationary(transition: np.ndarray) -> np.ndarray:
    """The stationary distribution ``[..., n]`` of row-stochastic ``transition [..., n, n]``: the
    solution of ``π P = π``, ``Σ π = 1`` (a linear solve; unique for an irreducible chain, which a
    Dirichlet draw is with probability 1)."""
    n = transition.shape[-1]
    system = np.swapaxes(transition, -1, -2) - np.eye(n)
    system[..., -1, :] = 1.0
    rhs = np.zeros(transition.shape[:-1])
    rhs[..., -1] = 1.0
    return np.linalg.solve(system, rhs[..., None])[..., 0]
