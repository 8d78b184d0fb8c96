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
    as_tuple = lambda result: (result,) if isinstance(result, torch.Tensor) else tuple(result)
    for got, want in zip(as_tuple(split), as_tuple(whole), strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
        assert got.is_inference()  # the caller's inference mode reached the worker threads


def test_small_batches_and_one_thread_are_not_split(two_threads):
    few = torch.randn(MIN_MATRICES_PER_THREAD, 4, 4)
    assert torch.equal(over_threads(torch.linalg.eigvals, few), torch.linalg.eigvals(few))
    torch.set_num_threads(1)
    many = torch.randn(10 * MIN_MATRICES_PER_THREAD, 4, 4)
    assert torch.equal(over_threads(torch.linalg.eigvals, many), torch.linalg.eigvals(many))


def test_a_slice_that_fails_raises_its_error_and_gives_the_threads_back(two_threads):
    def fails_on_the_second_slice(part):
        if threading.current_thread().name.startswith("linalg") and part[0, 0, 0] == 2.0:
            raise torch.linalg.LinAlgError("did not converge")
        return torch.linalg.eigvals(part)

    matrices = torch.ones(4 * MIN_MATRICES_PER_THREAD, 3, 3)
    matrices[2 * MIN_MATRICES_PER_THREAD :] = 2.0
    with pytest.raises(torch.linalg.LinAlgError, match="did not converge"):
        over_threads(fails_on_the_second_slice, matrices)
    assert torch.get_num_threads() == 2
