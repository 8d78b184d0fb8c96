"""Repeated random tokens, the generator: ``[BOS], t_1 .. t_n, t_1 .. t_n, t_1 ...``, a block of ``n`` i.i.d.
uniform tokens repeated with period ``n`` until the sequence is full (Olsson et al. 2022, "In-context
Learning and Induction Heads"). What the induction task (:mod:`data.tasks.repeated`) trains on and the
default probe (:mod:`data.probe`) is drawn from."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from data.counter_rng import random_ints

TOKEN_STREAM, LENGTH_STREAM = 0, 1


def repeated_tokens(
    seed: int,
    sample_ids: np.ndarray,
    seq_len: int,
    n_random: int,
    n_min: int,
    n_max: int,
    bos: bool = True,
) -> Tensor:
    """Token ids ``[len(sample_ids), seq_len]``; sample k is a pure function of ``(seed, k)``."""
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
    offset = int(bos)
    body_len = seq_len - offset
    block = torch.from_numpy(random_ints(seed, sample_ids, n_max, n_random, TOKEN_STREAM))  # (b, n_max)
    n = torch.from_numpy(random_ints(seed, sample_ids, 1, n_max - n_min + 1, LENGTH_STREAM)) + n_min  # (b, 1)
    period_index = torch.arange(body_len, device="cpu")[None, :] % n  # (b, body_len)
    body = block.gather(1, period_index)  # (b, body_len)
    if not bos:
        return body
    return torch.cat([torch.full((len(body), 1), n_random, dtype=body.dtype, device="cpu"), body], dim=1)
