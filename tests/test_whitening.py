"""The whitened ratio against a dense reference, and its invariance to residual GL transforms
(which change the model's weights but not its logits)."""

from __future__ import annotations

import pytest
import torch

from data.probe import ProbeBatch
from metrics.circuits import head_circuits
from metrics.composition import composition_scores, frobenius_ratio
from metrics.reparametrize import residual_transform
from metrics.snapshot import take_snapshot
from metrics.whitening import embedding_covariance, whiten
from tests.conftest import random_model


def random_gl(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, d, generator=g) / d**0.5 + torch.eye(d)  # well-conditioned, far from orthogonal


def test_embedding_covariance_is_the_covariance_of_every_token_position_sum():
    model = random_model()
    sums = (model.W_E[:, None, :] + model.W_pos[None, :, :]).reshape(-1, model.shape.d_model).double()
    torch.testing.assert_close(embedding_covariance(model), torch.cov(sums.T.detach(), correction=0))


def test_whitened_ratio_matches_dense():
    model = random_model()
    cov = embedding_covariance(model)
    values, vectors = torch.linalg.eigh(cov)
    half, inv_half = (vectors * values.sqrt()) @ vectors.T, (vectors / values.sqrt()) @ vectors.T
    got = composition_scores(whiten(head_circuits(model), cov))["K"]
    ov, qk = head_circuits(model).ov.dense(), head_circuits(model).qk.dense()  # d x d, original basis
    norm = torch.linalg.norm
    for l1, h1, l2, h2 in (~got.isnan()).nonzero().tolist():
        A = half @ ov[l1, h1] @ inv_half  # a writer-reader map in whitened coordinates
        B = (half @ qk[l2, h2] @ half).T
        assert got[l1, h1, l2, h2].item() == pytest.approx((norm(A @ B) / (norm(A) * norm(B))).item(), rel=1e-5)


def test_residual_gl_preserves_logits_and_whitened_scores_but_not_frobenius():
    model = random_model(n_layers=2, n_heads=2)
    transformed = residual_transform(model, random_gl(model.shape.d_model))
    tokens = torch.randint(0, 11, (4, 17))
    torch.testing.assert_close(transformed(tokens), model(tokens), rtol=1e-4, atol=1e-5)  # same function
    probe = ProbeBatch(tokens=tokens, n=8, first_start=1)
    before = take_snapshot(model, probe, ("frobenius", "whitened"), baseline_samples=50)
    after = take_snapshot(transformed, probe, ("frobenius", "whitened"), baseline_samples=50)
    for kind in "QKV":
        valid = ~before.composition["whitened"][kind].isnan()
        torch.testing.assert_close(after.composition["whitened"][kind][valid], before.composition["whitened"][kind][valid], rtol=1e-4, atol=0)
        change = (after.composition["frobenius"][kind][valid] - before.composition["frobenius"][kind][valid]).abs().max()
        assert change > 1e-2, kind  # the plain ratio is not invariant


def test_residual_rotation_leaves_frobenius_unchanged():
    model = random_model(n_layers=2, n_heads=2)
    rotation = torch.linalg.qr(torch.randn(model.shape.d_model, model.shape.d_model)).Q
    before = composition_scores(head_circuits(model), frobenius_ratio)["K"]
    after = composition_scores(head_circuits(residual_transform(model, rotation)), frobenius_ratio)["K"]
    valid = ~before.isnan()
    torch.testing.assert_close(after[valid], before[valid], rtol=1e-4, atol=0)
