"""Bigram sequences with triggers (Bietti et al. 2023, "Birth of a Transformer: A Memory Viewpoint").

Background tokens follow a fixed random bigram Markov chain (shared by every sequence). A few
trigger tokens are special: within one sequence, each trigger ``q_k`` is always followed by that
sequence's own output token ``o_k``, drawn uniformly per sequence. Predicting ``o_k`` after the
second occurrence of ``q_k`` needs an induction head; the bigram part is learnt in the weights.

Token ids ``0 .. n_random - 1`` are chain tokens; ``BOS`` is id ``n_random``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from data import reference_predictors
from data.counter_rng import random_ints, random_uniform
from data.task import Task, TokenSampler

STEP_STREAM, OUTPUT_STREAM = 2, 3


@dataclass(frozen=True)
class BigramChain:
    """A bigram chain ``cumulative [n, n]`` (row i: CDF of the token after i) and its triggers ``[k]``."""

    cumulative: Tensor
    triggers: Tensor


def make_chain(seed: int, n_random: int, n_triggers: int, concentration: float = 0.5) -> BigramChain:
    """Transition rows ~ Dirichlet(concentration); triggers are ``n_triggers`` distinct random tokens."""
    if not 1 <= n_triggers < n_random:
        raise ValueError(f"need 1 <= n_triggers < n_random, got {n_triggers} and {n_random}")
    rng = np.random.default_rng(seed)
    transition = rng.dirichlet(np.full(n_random, concentration), size=n_random)  # (n, n)
    cumulative = torch.from_numpy(np.cumsum(transition, axis=1))
    cumulative[:, -1] = 1.0  # guard against rounding leaving the top of a row below 1
    triggers = torch.from_numpy(rng.choice(n_random, size=n_triggers, replace=False))
    return BigramChain(cumulative=cumulative, triggers=triggers)


def bigram_trigger_tokens(
    chain: BigramChain, seed: int, sample_ids: np.ndarray, seq_len: int, bos: bool = True
) -> Tensor:
    """Token ids ``[len(sample_ids), seq_len]``; sample k is a pure function of ``(chain, seed, k)``."""
    n_random = chain.cumulative.shape[0]
    body_len = seq_len - int(bos)
    u = torch.from_numpy(random_uniform(seed, sample_ids, body_len, STEP_STREAM)).T.contiguous()  # (t, b)
    outputs = torch.from_numpy(random_ints(seed, sample_ids, len(chain.triggers), n_random, OUTPUT_STREAM))  # (b, k)
    body = torch.empty(len(sample_ids), body_len, dtype=torch.long, device="cpu")
    body[:, 0] = (u[0] * n_random).long().clamp(max=n_random - 1)
    for t in range(1, body_len):
        prev = body[:, t - 1]  # (b,)
        drawn = torch.searchsorted(chain.cumulative[prev], u[t, :, None]).squeeze(1).clamp(max=n_random - 1)
        is_trigger = prev[:, None] == chain.triggers[None, :]  # (b, k)
        triggered = (is_trigger.long() * outputs).sum(1)  # the sequence's output for that trigger
        body[:, t] = torch.where(is_trigger.any(1), triggered, drawn)
    if not bos:
        return body
    return torch.cat([torch.full((len(body), 1), n_random, dtype=torch.long, device="cpu"), body], dim=1)


@dataclass
class BigramTriggers(Task):
    """A fixed random bigram chain with ``n_triggers`` trigger tokens, each followed within a sequence
    by that sequence's own output token (the module docstring); the chain's rows are
    Dirichlet(``concentration``)."""

    name: str = "bigram_triggers"
    n_triggers: int = 4
    concentration: float = 0.5

    def problems(self, n_random: int, n_ctx: int) -> list[str]:
        problems = super().problems(n_random, n_ctx)
        if not 1 <= self.n_triggers < n_random:
            problems.append(f"data.n_triggers={self.n_triggers} must be in [1, {n_random - 1}]")
        if not self.concentration > 0:
            problems.append(f"data.concentration={self.concentration} must be > 0")
        return problems

    def sampler(self, n_random: int) -> TokenSampler:
        chain = make_chain(self.seed, n_random, self.n_triggers, self.concentration)
        return lambda ids: bigram_trigger_tokens(chain, self.seed, ids, self.seq_len, self.bos)

    def reference(self, sample_ids: np.ndarray, n_random: int) -> reference_predictors.ReferencePredictions:
        """Uniform; bigram (the chain's row, learnt in the weights: uniform after a trigger or BOS,
        whose next token is drawn per sequence); induction (bigram, but after a trigger seen before, its
        output): the last is the truth itself (Bietti et al.'s two stages, global bigram then induction)."""
        chain = make_chain(self.seed, n_random, self.n_triggers, self.concentration)
        tokens = bigram_trigger_tokens(chain, self.seed, sample_ids, self.seq_len, self.bos)
        rows = torch.diff(
            chain.cumulative, dim=1, prepend=torch.zeros(n_random, 1, dtype=chain.cumulative.dtype, device="cpu")
        )
        is_trigger = (tokens[..., None] == chain.triggers).any(-1)  # (b, t)
        flat = torch.full((n_random,), 1.0 / n_random, dtype=torch.float64, device="cpu")
        bigram = torch.where(
            (is_trigger | (tokens >= n_random))[..., None], flat, rows.double()[tokens.clamp(max=n_random - 1)]
        )
        recalled = reference_predictors.induction(tokens, n_random, fallback=bigram)
        induction = torch.where(is_trigger[..., None], recalled, bigram)
        positions = torch.arange(tokens.shape[1] - 1, device="cpu")
        predicted = {
            "uniform": reference_predictors.uniform(tokens, n_random),
            "bigram": bigram,
            "induction": induction,
        }
        return reference_predictors.ReferencePredictions(
            tokens, positions, reference_predictors.at_positions(predicted, positions), truth=induction[:, positions]
        )
