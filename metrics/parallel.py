"""Batched small-matrix LAPACK calls, split over threads.

On the CPU, torch decomposes a batch of small matrices (``torch.linalg.svd``, ``eigvals``) one
matrix after another on a single thread, whatever ``torch.get_num_threads()`` says: 256 SVDs of
32 × 32 took 35 ms with one torch thread and with two, 384 eigenvalue problems of 32 × 32 57 and
50 ms (measured on this project's 2-core machine). Torch releases the GIL inside an operator, so
the batch cut into one slice per thread and decomposed on a small thread pool runs those loops side
by side, each on one LAPACK thread: 17 and 24-31 ms there. Every matrix still goes through the
same LAPACK routine on its own, so the result is bitwise the unsplit call's.

Used by the snapshot's SVDs (:mod:`metrics.composition.engine`) and eigenvalue scores
(:mod:`metrics.heads.circuit_scores`), where paper-scale models decompose thousands of
``d_head × d_head`` matrices per snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch import Tensor

MIN_MATRICES_PER_THREAD = 32  # below this, waking a thread costs about what it saves

_pools: dict[int, ThreadPoolExecutor] = {}  # by number of workers, started on first use


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    if workers not in _pools:
        _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="linalg")
    return _pools[workers]


def over_threads(
    decompose: Callable[[Tensor], Tensor | tuple[Tensor, ...]], matrices: Tensor
) -> Tensor | tuple[Tensor, ...]:
    """``decompose(matrices)`` for a per-matrix ``torch.linalg`` function on ``matrices [..., m, n]``,
    its batch cut into ``torch.get_num_threads()`` slices decomposed at once on CPU threads (as one
    call on a GPU, on one thread, or for batches too small to gain). Returns what ``decompose``
    returns, bitwise: a tensor, or a plain tuple of tensors where it returns several, each with
    ``matrices``' leading dims."""
    *lead, m, n = matrices.shape
    count = matrices[..., 0, 0].numel()
    threads_before = torch.get_num_threads()
    threads = min(threads_before, count // MIN_MATRICES_PER_THREAD)
    if matrices.device.type != "cpu" or threads < 2:
        return decompose(matrices)
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()  # both are per thread

    def run(part: Tensor):
        # one LAPACK thread per slice: left at the caller's count, MKL would start a team of that many
        # inside every call, oversubscribing the cores (measured: slower than not splitting at all)
        torch.set_num_threads(1)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return decompose(part)

    pool = _thread_pool(threads)
    futures = [pool.submit(run, part) for part in matrices.reshape(count, m, n).chunk(threads)]
    try:
        wait(futures)  # every slice, failed or not, before the count is given back: none may set it after
    finally:
        torch.set_num_threads(threads_before)  # the setting is process-wide: give the caller its own back
    parts = [future.result() for future in futures]  # re-raises a slice's error (e.g. LinAlgError) here
    if isinstance(parts[0], Tensor):
        return torch.cat(parts).reshape(*lead, *parts[0].shape[1:])
    return tuple(torch.cat(outputs).reshape(*lead, *outputs[0].shape[1:]) for outputs in zip(*parts))
