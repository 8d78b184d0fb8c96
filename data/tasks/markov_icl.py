"""In-context Markov chains (Edelman, Edelman, Goel, Malach and Tsilivis 2024, "The Evolution of
Statistical Induction Heads: In-Context Learning Markov Chains"; their ``datasets.ngrams``).

Every sequence draws its own chain over ``k`` states: each row of the transition matrix (one per
context of ``order`` tokens) ~ Dirichlet(``alpha``·1). Its first ``order`` tokens come from the chain's
stationary distribution, then the chain runs to ``seq_len`` tokens. Nothing about one chain carries
to the next, so the only way to predict well is in context: uniform, then the in-context unigram
(token counts), then the in-context bigram (counts of what followed the current token), which under
the Dirichlet(1) prior is the Bayes predictor (add-one counts). With ``doubly_stochastic`` each matrix
is Sinkhorn-balanced so its columns also sum to 1: the stationary distribution is uniform and the
unigram strategy carries nothing (the paper's control).

Token ids are the states ``0 .. k - 1`` (the model's ``d_vocab`` is ``k``, plus one with BOS). A
sample is a pure function of ``(seed, sample id)``: its own NumPy generator, seeded by both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from data import reference_predictors
from data.probe import PROBE_SEED_OFFSET, ProbeBatch
from data.task import Task, TokenSampler

SINKHORN_STEPS = 200  # row and column normalisations: columns within ~1e-12 of 1 for k <= 8


@dataclass(frozen=True)
class Chains:
    """Sampled chains and their sequences: ``transition [b, k^order, k]`` (row c: the next-token
    distribution after context id ``c = Σ_i x_{j-i} k^i``), ``tokens [b, seq_len]`` (no BOS)."""

    transition: np.ndarray
    tokens: Tensor


def sinkhorn(matrix: np.ndarray, steps: int = SINKHORN_STEPS) -> np.ndarray:
    """``matrix [..., n, n]`` scaled to doubly stochastic by alternating row and column normalisation
    (Sinkhorn and Knopp 1967)."""
    for _ in range(steps):
        matrix = matrix / matrix.sum(-2, keepdims=True)
        matrix = matrix / matrix.sum(-1, keepdims=True)
    return matrix


def context_chain(transition: np.ndarray, k: int, order: int) -> np.ndarray:
    """The chain on contexts of ``order`` tokens ``[b, k^order, k^order]``: context
    ``(x_1 .. x_order)`` moves to ``(x_2 .. x_order, y)`` with the probability of ``y``."""
    n = k**order
    chain = np.zeros((*transition.shape[:-2], n, n))
    for c in range(n):
        for y in range(k):
            chain[..., c, (c * k) % n + y] += transition[..., c, y]
    return chain


def sample_chains(
    seed: int, sample_ids: np.ndarray, seq_len: int, k: int, alpha: float, order: int, doubly_stochastic: bool
) -> Chains:
    """One chain and one sequence per sample id (the module docstring)."""
    b, n_contexts = len(sample_ids), k**order
    transition = np.empty((b, n_contexts, k))
    uniforms = np.empty((b, seq_len))
    for row, sample in enumerate(sample_ids):
        rng = np.random.default_rng([seed, int(sample)])
        transition[row] = rng.dirichlet(np.full(k, alpha), size=n_contexts)
        uniforms[row] = rng.random(seq_len)
    transition = np.clip(transition, 1e-300, None)  # a Dirichlet(α < 1) draw can underflow to 0
    transition /= transition.sum(-1, keepdims=True)
    if doubly_stochastic:
        transition = sinkhorn(transition)
    start = reference_predictors.stationary(context_chain(transition, k, order))  # (b, k^order)
    first = (uniforms[:, :1] > np.cumsum(start, -1)[:, :-1]).sum(-1)  # the first context's id
    tokens = np.empty((b, seq_len), dtype=np.int64)
    for i in range(order):  # its tokens, most significant first
        tokens[:, i] = (first // k ** (order - 1 - i)) % k
    cumulative = np.cumsum(transition, -1)
    rows = np.arange(b)
    for j in range(order, seq_len):
        context = sum(tokens[:, j - 1 - i] * k**i for i in range(order))
        tokens[:, j] = (uniforms[:, j, None] > cumulative[rows, context, :-1]).sum(-1)
    return Chains(transition, torch.from_numpy(tokens))


@dataclass
class MarkovICL(Task):
    """A fresh ``k``-state chain per sequence (the module docstring): ``order`` 1 for bigram chains (the
    paper's), 2 for trigram chains; rows Dirichlet(``alpha``·1); ``doubly_stochastic``: uniform
    stationary distribution."""

    reader_behaviour = (
        "statistical_induction"  # Edelman et al. 2024: attention to the tokens after x_t's earlier occurrences
    )
    name: str = "markov_icl"
    batch_size: int = 64
    seq_len: int = 101
    bos: bool = False
    k: int = 2
    alpha: float = 1.0
    order: int = 1
    doubly_stochastic: bool = False

    def problems(self, n_random: int, n_ctx: int) -> list[str]:
        problems = super().problems(n_random, n_ctx)
        if self.k < 2:
            problems.append(f"data.k={self.k} must be >= 2")
        elif n_random != self.k:
            problems.append(
                f"data.k={self.k} needs model.d_vocab={self.k + int(self.bos)} (the k states{' and BOS' if self.bos else ''};"
                " experiment=markov_icl sets it),"
                f" got {n_random + int(self.bos)}"
            )
        if not self.alpha > 0:
            problems.append(f"data.alpha={self.alpha} must be > 0")
        if self.order not in (1, 2):
            problems.append(f"data.order={self.order} must be 1 (bigram chains) or 2 (trigram chains)")
        elif self.seq_len - int(self.bos) <= self.order:
            problems.append(
                f"data.seq_len={self.seq_len} leaves nothing to predict after the first {self.order} tokens"
            )
        elif (self.seq_len - int(self.bos)) // 2 < 2:
            problems.append(
                f"data.seq_len={self.seq_len}: the tracker's probe reads each chain as two halves (the loss views"
                f" and the ablation), of at least 2 tokens each: data.seq_len >= {4 + int(self.bos)}"
            )
        if self.doubly_stochastic and self.order != 1:
            problems.append("data.doubly_stochastic=true goes with data.order=1")
        return problems

    def chains(self, sample_ids: np.ndarray) -> Chains:
        return sample_chains(
            self.seed, sample_ids, self.seq_len - int(self.bos), self.k, self.alpha, self.order, self.doubly_stochastic
        )

    def sampler(self, n_random: int) -> TokenSampler:
        return lambda ids: with_bos(self.chains(ids).tokens, n_random, self.bos)

    def probe(self, seed: int, batch_size: int, n: int, n_random: int) -> ProbeBatch:
        """``batch_size`` held-out chains of the run's length, read as two halves of ``n' = (seq_len -
        BOS) // 2`` tokens (``tracker.probe_n`` does not apply): the "first occurrence" loss is the first
        half's, the "repeated" loss the second half's, where in-context statistics have piled up; the
        ablation and the data-aware share weigh those later positions. The head scores that read a
        repeat's offsets (induction, duplicate) mean nothing here; the previous-token score does."""
        half = (self.seq_len - int(self.bos)) // 2
        ids = np.arange(batch_size)
        tokens = with_bos(
            sample_chains(
                seed + PROBE_SEED_OFFSET,
                ids,
                self.seq_len - int(self.bos),
                self.k,
                self.alpha,
                self.order,
                self.doubly_stochastic,
            ).tokens,
            n_random,
            self.bos,
        )
        return ProbeBatch(tokens=tokens, n=half, first_start=int(self.bos))

    def reference(self, sample_ids: np.ndarray, n_random: int) -> reference_predictors.ReferencePredictions:
        """Uniform, in-context unigram, in-context bigram (and trigram for ``order=2``), add-one counts
        as the paper, and the chain's own transition row, at the last position: the model has seen
        ``seq_len - 1`` tokens and predicts the next (the paper's ``test_last_token``)."""
        chains = self.chains(sample_ids)
        tokens = with_bos(chains.tokens, n_random, self.bos)
        body = chains.tokens[:, :-1]  # what the model has seen at the last scored position
        predicted = {
            "uniform": reference_predictors.uniform(body, self.k),
            "unigram": reference_predictors.unigram(body, self.k),
        }
        predicted["bigram"] = reference_predictors.ngram(body, self.k, 1)
        if self.order == 2:
            predicted["trigram"] = reference_predictors.ngram(body, self.k, 2)
        last = body.shape[1] - 1
        context = sum(body[:, last - i].numpy() * self.k**i for i in range(self.order))
        truth = torch.from_numpy(chains.transition[np.arange(len(body)), context])[:, None, :]  # (b, 1, k)
        position = torch.tensor([last + int(self.bos)], device="cpu")
        return reference_predictors.ReferencePredictions(
            tokens=tokens,
            positions=position,
            strategies={name: q[:, [last]] for name, q in predicted.items()},
            truth=truth,
        )


def with_bos(tokens: Tensor, n_random: int, bos: bool) -> Tensor:
    """``tokens [b, t]`` with BOS (id ``n_random``) in front when ``bos``."""
    if not bos:
        return tokens
    return torch.cat([torch.full((len(tokens), 1), n_random, dtype=tokens.dtype, device="cpu"), tokens], dim=1)
