"""A batch of small matrix decompositions split over threads on the CPU.

Torch decomposes a batch of small general matrices (``torch.linalg.eigvals``) one after another on the
CPU, on one core however many it has. Parts of the batch on as many threads as torch may use (each call
releases the GIL) give the same result bit for bit, sooner: 1,000 general eigendecompositions of
64 x 64 took 0.77 against 0.51 s on two cores, the matching scores of a 4 x 8 x 256 x 32 model 64-75
against 43-51 ms (the matching score's at 12 x 12 x 768 x 64 are 9,504 of those a snapshot). Written
here because torch has no such switch. (Batched SVDs split alike were faster alone, 85 against 44 ms
for 256 of 32 x 32, but a snapshot's composition scores came out no faster with them: not used there.)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import torch
from torch import Tensor

MATRICES_A_THREAD = 16
"""The fewest matrices worth a thread of their own: below, the hand-over costs more than it saves."""


@cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool per size, kept: a thread's first torch call sets up its own thread-local state."""
    return ThreadPoolExecutor(workers, thread_name_prefix="decompositions")


if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads: its own pools
    os.register_at_fork(after_in_child=_pool.cache_clear)


def over_threads(decompose: Callable[[Tensor], Tensor | tuple[Tensor, ...]], matrices: Tensor):
    """``decompose(matrices)`` for ``matrices [..., m, n]``, its batch split over ``torch.get_num_threads()``
    threads on the CPU (at most one per :data:`MATRICES_A_THREAD` matrices): the same tensor, or tensors
    (a tuple), as one call, each with the batch's leading dims. Elsewhere (a GPU, one thread, a small
    batch): one call."""
    batch = matrices.shape[:-2]
    count = math.prod(batch)
    threads = min(torch.get_num_threads(), count // MATRICES_A_THREAD)
    if matrices.device.type != "cpu" or threads < 2:
        return decompose(matrices)
    parts = list(_pool(threads).map(decompose, matrices.reshape(count, *matrices.shape[-2:]).chunk(threads)))
    if isinstance(parts[0], Tensor):
        return torch.cat(parts).view(*batch, *parts[0].shape[1:])
    return tuple(torch.cat(pieces).view(*batch, *pieces[0].shape[1:]) for pieces in zip(*parts))
