"""Batched LAPACK split over threads returns bitwise what the single call returns."""

from __future__ import annotations

import threading

import pytest
import torch

from metrics.parallel import MIN_MATRICES_PER_THREAD, over_threads


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("size, dtype", [(12, torch.float64), (32, torch.float32)])
@pytest.mark.parametrize("decompose", [torch.linalg.svd, torch.linalg.eigvals, torch.linalg.eigvalsh])
def test_split_decompositions_equal_the_single_call_bitwise(decompose, size, dtype, two_threads):
    generator = torch.Generator().manual_seed(0)
    matrices = torch.randn(3, 5 * MIN_MATRICES_PER_THREAD + 7, size, size, generator=generator, dtype=dtype)
    if decompose is torch.linalg.eigvalsh:
        matrices = matrices @ matrices.mT
    callers = []

    def recorded(part):
        callers.append(threading.current_thread().name)
        return decompose(part)

    with torch.inference_mode():
        split, whole = over_threads(recorded, matrices), decompose(matrices)
    assert len(callers) == 2 and all(name.startswith("linalg") for name in callers)  # two slices, on the pool
    assert torch.get_num_threads() == 2  # the workers ran on one thread each; the caller has its two back
    split, whole = (split, whole) if isinstance(whole, torch.Tensor) else (split, tuple(whole))
    for got, want in zip(split if isinstance(split, tuple) else (split,), whole if isinstance(whole, tuple) else (whole,)):
        assert got.shape == want.shape and torch.equal(got, want)
        assert got.is_inference()  # the caller's inference mode reached the worker threads


def test_small_batches_and_one_thread_are_not_split(two_threads):
    few = torch.randn(MIN_MATRICES_PER_THREAD, 4, 4)
    assert torch.equal(over_threads(torch.linalg.eigvals, few), torch.linalg.eigvals(few))
    torch.set_num_threads(1)
    many = torch.randn(10 * MIN_MATRICES_PER_THREAD, 4, 4)
    assert torch.equal(over_threads(torch.linalg.eigvals, many), torch.linalg.eigvals(many))
