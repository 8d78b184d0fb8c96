"""A batch of decompositions split over threads (:mod:`metrics.batched`) equals one call, bit for bit."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from metrics.batched import MATRICES_A_THREAD, over_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_split_svd_and_eigenvalues_equal_one_call_bit_for_bit(two_threads):
    generator = torch.Generator().manual_seed(0)
    matrices = torch.randn(3, 2, 4 * MATRICES_A_THREAD + 1, 8, 8, generator=generator)  # an odd batch, leading dims
    for decompose in (torch.linalg.svd, torch.linalg.eigvals):
        whole, split = decompose(matrices), over_threads(decompose, matrices)
        whole = whole if isinstance(whole, tuple) else (whole,)
        split = split if isinstance(split, tuple) else (split,)
        assert [t.shape for t in split] == [t.shape for t in whole]
        assert all(torch.equal(a, b) for a, b in zip(split, whole, strict=True))


def test_a_small_batch_or_one_thread_is_one_call(two_threads):
    calls = []

    def counted(matrices):
        calls.append(matrices.shape)
        return torch.linalg.eigvals(matrices)

    over_threads(counted, torch.randn(MATRICES_A_THREAD, 4, 4))  # too few for two threads
    torch.set_num_threads(1)
    over_threads(counted, torch.randn(8 * MATRICES_A_THREAD, 4, 4))
    assert calls == [(MATRICES_A_THREAD, 4, 4), (8 * MATRICES_A_THREAD, 4, 4)]
    torch.set_num_threads(2)
    over_threads(counted, torch.randn(8 * MATRICES_A_THREAD, 4, 4))
    assert calls[2:] == [(4 * MATRICES_A_THREAD, 4, 4)] * 2


def test_a_forked_child_splits_on_its_own_threads(two_threads):
    matrices = torch.randn(4 * MATRICES_A_THREAD, 6, 6)
    expected = torch.linalg.eigvals(matrices)
    assert torch.equal(over_threads(torch.linalg.eigvals, matrices), expected)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool threads are not here
        code = 1
        try:
            torch.set_num_threads(1)  # no OpenMP team of the parent's either (see reports.plots.DrawnAside)
            torch.set_num_threads(2)
            signal.alarm(30)
            code = 0 if torch.equal(over_threads(torch.linalg.eigvals, matrices), expected) else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
