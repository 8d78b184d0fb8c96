"""The fixed, held-out probe batch the tracker measures on (docs/measures.md, "Head and circuit scores").

``[BOS], t_1 .. t_n, (gap), t_1 .. t_n``: a block of first occurrences and its one repeat, always
with the same ``n`` and the same distance between the copies, so head scores can read the attention
at known offsets. The default probe (:func:`make_probe_batch`) has no gap and is drawn from a seed
stream no training sample uses, so it is held out by construction; a task may lay out its own
(:meth:`data.task.Task.probe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from data.repeated_tokens import repeated_tokens

PROBE_SEED_OFFSET = 0x5EED_0F_9_0BE  # keeps probe draws apart from every training seed


@dataclass(frozen=True)
class ProbeBatch:
    """Probe tokens ``[batch, pos]`` holding a block of ``n`` tokens at ``first_start`` and its
    repeat ``gap`` tokens after the block ends."""

    tokens: Tensor
    n: int
    first_start: int  # position of t_1 in the first copy (1 with BOS, else 0)
    gap: int = 0  # tokens between the first copy's end and the repeat

    @property
    def repeat_start(self) -> int:
        """Position of t_1 in the second copy."""
        return self.first_start + self.n + self.gap

    @property
    def period(self) -> int:
        """How far back a repeated token first occurred: the duplicate-token offset (the induction
        target, the token after it, is ``period - 1`` back)."""
        return self.n + self.gap

    @property
    def first(self) -> slice:
        """The positions whose next token is a first occurrence ``t_1 .. t_n`` (``t_1``'s only with BOS):
        the first-occurrence loss's, in ``token_losses``' indexing (entry j predicts token j + 1)."""
        return slice(max(self.first_start - 1, 0), self.first_start + self.n - 1)

    @property
    def repeated(self) -> slice:
        """The positions whose next token is a repeat ``t_2 .. t_n``: the repeated-token loss's. The
        repeat of ``t_1`` is left out: nothing in the context announces where the repeat begins."""
        return slice(self.repeat_start, self.repeat_start + self.n - 1)


def make_probe_batch(seed: int, batch_size: int, n: int, n_random: int, bos: bool = True) -> ProbeBatch:
    """The default probe batch for a run (no gap): a pure function of its arguments."""
    ids = np.arange(batch_size)
    tokens = repeated_tokens(seed + PROBE_SEED_OFFSET, ids, 2 * n + int(bos), n_random, n, n, bos)
    return ProbeBatch(tokens=tokens, n=n, first_start=int(bos))
