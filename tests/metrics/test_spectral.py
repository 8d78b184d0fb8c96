"""Measures 3, 5, 6 of docs/measures.md against dense references and known values."""

from __future__ import annotations

import pytest
import torch

from metrics.composition.baseline import random_baselines
from metrics.composition.circuits import LowRank, head_circuits
from metrics.composition.engine import composition_scores
from metrics.composition.measures import (
    aligned_pair_stats,
    best_component_ratio,
    best_component_share,
    component_scores,
    singular_value_bound_ratio,
    subspace_overlap,
)
from tests.helpers import dense_reader_factors, hand_centre, hand_fold, random_low_rank, random_model


def pairs(n=6, d=12, r=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return random_low_rank(n, d, r, g), random_low_rank(n, d, r, g)


def dense_sv_bound(A, B):
    sa, sb = torch.linalg.svdvals(A), torch.linalg.svdvals(B)  # descending, length d (zeros past rank)
    return torch.linalg.norm(A @ B) / (sa * sb).square().sum().sqrt()


def projector(factor):
    q = torch.linalg.qr(factor).Q
    return q @ q.T


def dense_overlap(writer_right, reader_left):
    r = min(writer_right.shape[-1], reader_left.shape[-1])
    return torch.trace(projector(writer_right) @ projector(reader_left)) / r  # Σ cos²θ = tr(P_w P_r)


def dense_components(A, B, r):
    u, s, vh = torch.linalg.svd(A)
    components = [s[i] * torch.outer(u[:, i], vh[i]) for i in range(r)]
    norm = torch.linalg.norm
    scores = torch.stack([norm(c @ B) / (norm(c) * norm(B)) for c in components])
    energies = torch.stack([norm(c @ B) ** 2 for c in components])
    return scores, energies / norm(A @ B) ** 2


def test_singular_value_bound_matches_dense():
    writers, readers = pairs()
    got = singular_value_bound_ratio(writers, readers)
    want = torch.stack([dense_sv_bound(a, b) for a, b in zip(writers.dense(), readers.dense())])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_subspace_overlap_matches_dense():
    writers, readers = pairs(seed=1)
    got = subspace_overlap(writers, readers)
    want = torch.stack([dense_overlap(w, r) for w, r in zip(writers.right, readers.left)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_per_component_matches_dense():
    writers, readers = pairs(seed=2)
    scores, shares = component_scores(aligned_pair_stats(writers, readers))
    for i, (a, b) in enumerate(zip(writers.dense(), readers.dense())):
        want_scores, want_shares = dense_components(a, b, 4)
        torch.testing.assert_close(scores[i], want_scores, rtol=1e-5, atol=0)
        torch.testing.assert_close(shares[i], want_shares, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(shares.sum(-1), torch.ones(6, dtype=torch.float64))
    best = scores.argmax(-1)
    torch.testing.assert_close(best_component_ratio(writers, readers), scores.max(-1).values)
    torch.testing.assert_close(best_component_share(writers, readers), shares.gather(-1, best[:, None]).squeeze(-1))


def aligned_pair(d=10, r=3, seed=0):
    """A writes exactly where B reads, singular values in the same order."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    out, shared, inp = basis[:, :r], basis[:, r : 2 * r], basis[:, 2 * r : 3 * r]
    s_a = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    s_b = torch.tensor([5.0, 0.5, 0.1], dtype=torch.float64)
    A = LowRank(inp[None], (shared * s_a)[None])  # A = inp diag(s_a) sharedᵀ: writes along `shared`
    B = LowRank((shared * s_b)[None], out[None])  # B reads along `shared`
    misordered = LowRank((shared * s_b.flip(0))[None], out[None])  # same subspace, reversed importance
    return A, B, misordered, basis, s_b


def test_aligned_scores_one_and_orthogonal_scores_zero():
    A, B, _, basis, s_b = aligned_pair()
    assert singular_value_bound_ratio(A, B).item() == pytest.approx(1.0, rel=1e-12)
    assert subspace_overlap(A, B).item() == pytest.approx(1.0, rel=1e-12)
    # A's top component meets B's top read direction; the ratio still divides by all of ‖B‖
    assert best_component_ratio(A, B).item() == pytest.approx((s_b[0] / s_b.norm()).item(), rel=1e-12)
    orthogonal = LowRank(basis[None, :, 6:9], basis[None, :, :3])  # reads a subspace A never writes
    for measure in (singular_value_bound_ratio, subspace_overlap, best_component_ratio):
        assert measure(A, orthogonal).abs().item() < 1e-12, measure.__name__


def test_sv_bound_penalises_misordered_alignment():
    A, _, misordered, _, _ = aligned_pair()
    assert subspace_overlap(A, misordered).item() == pytest.approx(1.0, rel=1e-12)  # blind to order
    s_a, s_b = (torch.tensor(v, dtype=torch.float64) for v in ([3.0, 2.0, 1.0], [5.0, 0.5, 0.1]))
    expected = (s_a * s_b.flip(0)).norm() / (s_a * s_b).norm()  # ‖AB‖ pairs 3 with 0.1, bound pairs 3 with 5
    assert singular_value_bound_ratio(A, misordered).item() == pytest.approx(expected.item(), rel=1e-9)


def test_random_subspace_baseline_is_r_over_d():
    baseline = random_baselines(64, 16, 2000, 0)[subspace_overlap.name]
    assert baseline.mean == pytest.approx(16 / 64, rel=0.02)  # E[tr(P_w P_r)] / r = r / d


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_new_measures_on_a_model_match_per_pair_dense(normalization, kind):
    model = random_model(normalization)
    circuits = head_circuits(model, torch.float64)
    scores = {
        m: composition_scores(circuits, m)[m.name][kind]
        for m in (singular_value_bound_ratio, subspace_overlap, best_component_ratio, best_component_share)
    }
    for l1, h1, l2, h2 in (~scores[subspace_overlap].isnan()).nonzero().tolist():
        writer = model.layers[l1]
        W_O = hand_centre(writer.norm, writer.W_O[h1])
        A = hand_fold(writer.norm, writer.W_V[h1]) @ W_O
        read, B = dense_reader_factors(model, l2, h2, kind)
        want = {
            singular_value_bound_ratio: dense_sv_bound(A, B),
            subspace_overlap: dense_overlap(W_O.T, read),
            best_component_ratio: dense_components(A, B, model.shape.d_head)[0].max(),
            best_component_share: dense_components(A, B, model.shape.d_head)[1][
                dense_components(A, B, model.shape.d_head)[0].argmax()
            ],
        }
        for measure, value in want.items():
            assert scores[measure][l1, h1, l2, h2].item() == pytest.approx(value.item(), rel=1e-5), measure.__name__
