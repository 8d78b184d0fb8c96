"""Copying and matching scores against dense ``d_vocab x d_vocab`` eigenvalues, and on the hand-built circuit."""

from __future__ import annotations

import pytest
import torch

from metrics.composition.circuits import head_circuits
from metrics.heads.circuit_scores import copying_scores, matching_scores
from tests.helpers import induction_circuit_model, random_model


def dense_positivity(matrix):
    eigenvalues = torch.linalg.eigvals(matrix)
    return (eigenvalues.real.sum() / eigenvalues.abs().sum()).item()


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_copying_score_matches_dense_full_ov_circuit(normalization):
    model = random_model(normalization)
    circuits = head_circuits(model, torch.float64)
    W_E = model.W_E.detach().double()
    gain = (
        model.final_norm.weight.detach().double()
        if normalization != "none"
        else torch.ones(model.shape.d_model, dtype=torch.float64)
    )
    W_U = gain[:, None] * model.W_U.detach().double()
    W_U = W_U - W_U.mean(0, keepdim=True) if normalization == "layernorm" else W_U  # LayerNorm's centring
    scores = copying_scores(model, circuits)
    for layer in range(model.shape.n_layers):
        for head in range(model.shape.n_heads):
            full_ov = W_E @ circuits.ov.dense()[layer, head] @ W_U  # (d_vocab, d_vocab)
            assert scores[layer, head].item() == pytest.approx(dense_positivity(full_ov), rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_matching_score_matches_dense(normalization):
    model = random_model(normalization)
    circuits = head_circuits(model, torch.float64)
    W_E = model.W_E.detach().double()
    scores = matching_scores(model, circuits)
    ov, qk = circuits.ov.dense(), circuits.qk.dense()
    for l1, h1, l2, h2 in (~scores.isnan()).nonzero().tolist():
        full = W_E @ qk[l2, h2] @ (W_E @ ov[l1, h1]).T
        assert scores[l1, h1, l2, h2].item() == pytest.approx(dense_positivity(full), rel=1e-5, abs=1e-9)
    assert scores[1, :, 0, :].isnan().all() and scores[0, :, 0, :].isnan().all()


def test_hand_built_induction_head_copies_and_matches():
    model = induction_circuit_model()
    circuits = head_circuits(model, torch.float64)
    assert copying_scores(model, circuits)[1, 0].item() == pytest.approx(1.0, abs=1e-9)  # copies TOKEN -> OUT -> logits
    assert matching_scores(model, circuits)[0, 0, 1, 0].item() == pytest.approx(1.0, abs=1e-9)
