"""The fixed, held-out probe batch the tracker measures on (docs/measures.md, "Head and circuit scores").

``[BOS], t_1 .. t_n, t_1 .. t_n``: the first occurrences and their one repeat, always with the
same ``n``, so head scores can read the attention at known offsets. Drawn from a seed stream no
training sample uses, so it is held out by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from data.repeated import repeated_tokens

PROBE_SEED_OFFSET = 0x5EED_0F_9_0BE  # keeps probe draws apart from every training seed


@dataclass(frozen=True)
class ProbeBatch:
    """Probe tokens ``[batch, 2 n + bos]`` and where their two copies start."""

    tokens: Tensor
    n: int
    first_start: int  # position of t_1 in the first copy (1 with BOS, else 0)

    @property
    def repeat_start(self) -> int:
        """Position of t_1 in the second copy."""
        return self.first_start + self.n


def make_probe_batch(seed: int, batch_size: int, n: int, n_random: int, bos: bool = True) -> ProbeBatch:
    """The probe batch for a run: a pure function of its arguments."""
    ids = np.arange(batch_size)
    tokens = repeated_tokens(seed + PROBE_SEED_OFFSET, ids, 2 * n + int(bos), n_random, n, n, bos)
    return ProbeBatch(tokens=tokens, n=n, first_start=int(bos))
