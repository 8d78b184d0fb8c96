"""Repeated random tokens: the induction task (Olsson et al. 2022, "In-context Learning and
Induction Heads").

A sequence is ``[BOS], t_1 .. t_n, t_1 .. t_n, t_1 ...``: ``n`` i.i.d. uniform tokens, then the
same block repeated with period ``n`` until the sequence is full. ``n`` is drawn per sample from
``[n_min, n_max]``, so no fixed position offset predicts the repeat: a one-layer model cannot
shortcut the task by attending ``n - 1`` positions back, and only an induction circuit (a
previous-token head K-composing with an induction head) solves it. With ``n_min == n_max`` and
``seq_len == 2 n + 1`` this is exactly docs/measures.md's probe layout.

What "a longer context" means here has two honest answers, and ``block`` picks one: ``fixed``, the
repeat distance stays ``n_min .. n_max`` and a longer sequence holds more repeats of the block;
``half_context``, the block grows with the sequence, ``n_max = (seq_len − BOS) // 2`` and ``n_min =
ceil(n_max / 2)`` (``n_min`` and ``n_max`` as set are then not used): the dependency gets longer.

Token ids ``0 .. n_random - 1`` are random tokens; ``BOS`` is id ``n_random``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data import reference_predictors
from data.repeated_tokens import repeated_tokens
from data.task import Task, TokenSampler

BLOCKS = ("fixed", "half_context")


@dataclass
class Repeated(Task):
    """``[BOS], t_1 .. t_n, t_1 .. t_n, ...``: a block of ``n ~ U{n_min..n_max}`` uniform random
    tokens repeated until the sequence is full (the module docstring)."""

    name: str = "repeated"
    n_min: int = 8
    n_max: int = 16
    block: str = "fixed"  # fixed: n_min .. n_max; half_context: n_max = (seq_len − BOS) // 2, n_min = ceil(n_max / 2)

    def __post_init__(self) -> None:
        if self.block == "half_context":
            self.n_max = (self.seq_len - int(self.bos)) // 2
            self.n_min = -(-self.n_max // 2)

    def problems(self, n_random: int, n_ctx: int) -> list[str]:
        problems = super().problems(n_random, n_ctx)
        if self.block not in BLOCKS:
            problems.append(f"data.block={self.block!r}: must be one of {', '.join(BLOCKS)}")
        elif not 1 <= self.n_min <= self.n_max:
            problems.append(f"data.n_min={self.n_min}, data.n_max={self.n_max}: need 1 <= n_min <= n_max")
        elif self.seq_len - int(self.bos) <= self.n_max:
            problems.append(
                f"data.seq_len={self.seq_len} leaves no room to repeat a block of data.n_max={self.n_max} tokens"
                f" (need seq_len > n_max{' + 1 for BOS' if self.bos else ''})"
            )
        return problems

    def probe_block(self) -> int:
        """The longest repeat distance it trains on, ``n_max``, within half the context: the probe
        repeats its block at a distance the model has learnt (16 at the defaults)."""
        return max(min(self.n_max, (self.seq_len - int(self.bos)) // 2), 2)

    def sampler(self, n_random: int) -> TokenSampler:
        return lambda ids: repeated_tokens(self.seed, ids, self.seq_len, n_random, self.n_min, self.n_max, self.bos)

    def reference(self, sample_ids: np.ndarray, n_random: int) -> reference_predictors.ReferencePredictions:
        """Uniform, copy and induction (:meth:`Task.reference`), scored on the repeats: the positions
        whose next token repeats one seen ``n`` back, from the repeat's second token on, for every
        ``n`` up to ``n_max`` (positions ``n_max + BOS .. seq_len - 2``; the loss views' "repeated"
        positions). Elsewhere the next token is new and no strategy but uniform can know it."""
        reference = super().reference(sample_ids, n_random)
        keep = slice(self.n_max + int(self.bos), None)  # the default scores every position from 0
        return reference_predictors.ReferencePredictions(
            reference.tokens,
            reference.positions[keep],
            {name: q[:, keep] for name, q in reference.strategies.items()},
        )
