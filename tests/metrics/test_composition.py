"""Composition scores against a dense reference, the layer-order mask, the random baseline, and
a hand-built previous-token + induction circuit that must K-compose (docs/measures.md)."""

from __future__ import annotations

import math

import pytest
import torch

from metrics.composition.baseline import random_baselines
from metrics.composition.circuits import LowRank, head_circuits
from metrics.composition.engine import composition_scores
from metrics.composition.measures import frobenius_ratio
from tests.helpers import induction_circuit_model, random_model


def frobenius(model):
    """Frobenius composition ``{kind: [L, H, L, H]}`` of every pair, float64."""
    return composition_scores(head_circuits(model, torch.float64), frobenius_ratio)["frobenius"]


def dense_weights(model):
    """Per layer ``(W_Q, W_K, W_V, W_O)`` in float64 with the norm folded in, by plain indexing: the
    gain, and under LayerNorm the centring matrix ``C = I - 11ᵀ/d_model`` (``C diag(g) W``), which
    also centres the writer (``W_O C``)."""
    out = []
    d = model.shape.d_model
    for layer in model.layers:
        gain = getattr(layer.norm, "weight", None)
        g = torch.ones(d, dtype=torch.float64) if gain is None else gain.detach().double()
        centres = isinstance(layer.norm, torch.nn.LayerNorm)
        C = torch.eye(d, dtype=torch.float64) - centres * torch.full((d, d), 1 / d, dtype=torch.float64)
        fold = lambda w, g=g, C=C: C @ torch.diag(g) @ w.detach().double()
        out.append(
            (
                [fold(w) for w in layer.W_Q],
                [fold(w) for w in layer.W_K],
                [fold(w) for w in layer.W_V],
                [w.detach().double() @ C for w in layer.W_O],
            )
        )
    return out


def dense_reference(model, kind):
    """Frobenius composition by forming every d_model x d_model matrix (the slow, obvious way)."""
    weights = dense_weights(model)
    L, H = model.shape.n_layers, model.shape.n_heads
    ref = torch.full((L, H, L, H), math.nan, dtype=torch.float64)
    for l1 in range(L):
        for h1 in range(H):
            W_OV = weights[l1][2][h1] @ weights[l1][3][h1]
            for l2 in range(l1 + 1, L):
                for h2 in range(H):
                    Q, K, V, O = (weights[l2][i][h2] for i in range(4))
                    reader = {"Q": Q @ K.T, "K": (Q @ K.T).T, "V": V @ O}[kind]
                    ref[l1, h1, l2, h2] = torch.linalg.norm(W_OV @ reader) / (
                        torch.linalg.norm(W_OV) * torch.linalg.norm(reader)
                    )
    return ref


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_frobenius_matches_dense_reference(normalization, kind):
    model = random_model(normalization)
    scores = frobenius(model)[kind]
    torch.testing.assert_close(scores, dense_reference(model, kind), rtol=1e-5, atol=0, equal_nan=True)


def test_norm_gains_change_the_scores():
    """Folding matters: the same weights with and without the gains score differently."""
    model = random_model("layernorm")
    with_gain = frobenius(model)["K"]
    for layer in model.layers:
        torch.nn.init.ones_(layer.norm.weight)
    without_gain = frobenius(model)["K"]
    valid = ~with_gain.isnan()
    assert (with_gain[valid] - without_gain[valid]).abs().max() > 1e-3


def test_layer_order_mask():
    model = random_model(n_layers=3, n_heads=2)
    scores = frobenius(model)["K"]
    for l1 in range(3):
        for l2 in range(3):
            block = scores[l1, :, l2, :]
            assert block.isnan().all() == (l2 <= l1), (l1, l2)
            assert (~block.isnan()).all() == (l2 > l1), (l1, l2)


def test_identity_scores_inverse_sqrt_dimension():
    """Seed 002's quirk: A = B = I (rank d) scores d^-1/2, not 1."""
    d = 9
    eye = torch.eye(d, dtype=torch.float64)[None]
    assert frobenius_ratio(LowRank(eye, eye), LowRank(eye, eye)).item() == pytest.approx(d**-0.5, rel=1e-12)


def test_rank_one_aligned_scores_one():
    u, v, w = (torch.randn(1, 7, 1, dtype=torch.float64) for _ in range(3))
    assert frobenius_ratio(LowRank(u, v), LowRank(v, w)).item() == pytest.approx(1.0, rel=1e-12)


def test_random_baseline_near_inverse_sqrt_d_model_and_small_stderr():
    baseline = random_baselines(64, 16, 2000, 0)[frobenius_ratio.name]
    assert baseline.mean == pytest.approx(64**-0.5, rel=0.05)
    assert 0 < baseline.stderr < 0.005 * baseline.mean
    # an independent draw agrees within a few standard errors
    other = random_baselines(64, 16, 2000, 1)[frobenius_ratio.name]
    assert abs(other.mean - baseline.mean) < 5 * math.hypot(baseline.stderr, other.stderr)


def test_random_baseline_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    random_baselines(32, 8, 500, 7)[frobenius_ratio.name]
    assert torch.equal(torch.rand(3), expected)


def test_hand_built_induction_pair_k_composes():
    """A previous-token head (L0H0) feeding an induction head (L1H0): K must be the score that rises.

    Pasting the paper's column-vector formula onto row-vector weights would swap Q and K.
    """
    model = induction_circuit_model()
    scores = frobenius(model)
    k = scores["K"][0, 0, 1, 0].item()
    assert k == pytest.approx(model.shape.d_vocab**-0.5, rel=1e-9)  # identity maps of rank d_vocab: d^-1/2
    assert scores["Q"][0, 0, 1, 0].item() < 1e-9
    assert scores["V"][0, 0, 1, 0].item() < 1e-9
    for kind, grid in scores.items():
        others = grid.clone()
        if kind == "K":
            others[0, 0, 1, 0] = math.nan
        assert torch.nan_to_num(others, nan=-1.0).max() < k, kind
