"""The whitened ratio against a dense reference, and its invariance to residual GL transforms
(which change the model's weights but not its logits)."""

from __future__ import annotations

import pytest
import torch

from bench.reparametrize import residual_transform
from data.probe import ProbeBatch
from metrics.composition.circuits import head_circuits
from metrics.composition.engine import composition_scores
from metrics.composition.measures import frobenius_ratio
from metrics.composition.scores import composition_of
from metrics.composition.whitening import embedding_covariance
from metrics.snapshot import take_snapshot
from tests.helpers import dense_reader_factors, hand_centre, random_model


def random_gl(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, d, generator=g) / d**0.5 + torch.eye(d)  # well-conditioned, far from orthogonal


def test_embedding_covariance_is_the_covariance_of_every_token_position_sum():
    model = random_model()
    sums = (model.W_E[:, None, :] + model.W_pos[None, :, :]).reshape(-1, model.shape.d_model).double()
    torch.testing.assert_close(embedding_covariance(model, torch.float64), torch.cov(sums.T.detach(), correction=0))


def observed_residual_rows(model, tokens):
    """Every layer's input, through the training forward path (SDPA), rows pooled: ``[L * b * t, d]``."""
    rows, x = [], model.embed(tokens)
    for layer in model.layers:
        rows.append(x.reshape(-1, x.shape[-1]))
        x = layer(x)
    return torch.cat(rows).double().detach()


@pytest.mark.parametrize("measure", ["whitened", "whitened_resid"])
@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_whitened_ratio_matches_dense(measure, normalization, kind):
    """Every d_model x d_model matrix formed from the raw weights (gains folded by hand, ``W_O``
    centred under LayerNorm), mapped to the whitened basis: readers gain Σ^(1/2) on each reading side,
    writers Σ^(-1/2) on the writing side. Under LayerNorm Σ is the covariance of the centred rows,
    singular along 1: its powers are taken on ``1⊥`` alone (0 along 1), not filled as the code's are."""
    model = random_model(normalization)
    tokens = torch.randint(0, 11, (4, 17), generator=torch.Generator().manual_seed(1))
    if measure == "whitened":
        rows = (model.W_E[:, None, :] + model.W_pos[None, :, :]).reshape(-1, model.shape.d_model).double().detach()
    else:
        rows = observed_residual_rows(model, tokens)
    values, vectors = torch.linalg.eigh(torch.cov(hand_centre(model.final_norm, rows).T, correction=0))
    if normalization == "layernorm":  # drop the null direction, 1
        assert values[0].abs() < 1e-12 and (vectors[:, 0].abs() - model.shape.d_model**-0.5).abs().max() < 1e-9
        values, vectors = values[1:], vectors[:, 1:]
    half, inv_half = (vectors * values.sqrt()) @ vectors.T, (vectors / values.sqrt()) @ vectors.T
    with torch.no_grad():
        residual = model.run_with_cache(tokens)[1]["resid_pre"]
    got = composition_of(model, (measure,), residual=residual, dtype=torch.float64)[measure][kind]
    norm = torch.linalg.norm
    for l1, h1, l2, h2 in (~got.isnan()).nonzero().tolist():
        V = dense_reader_factors(model, l1, h1, "V")[1]  # the writer's W_OV = W_V W_O, gain folded
        A = half @ V @ inv_half
        _, B = dense_reader_factors(model, l2, h2, kind)
        B = half @ B @ (inv_half if kind == "V" else half)
        assert got[l1, h1, l2, h2].item() == pytest.approx((norm(A @ B) / (norm(A) * norm(B))).item(), rel=1e-5)


def test_whitened_resid_needs_the_residual_stream():
    with pytest.raises(ValueError, match="residual stream"):
        composition_of(random_model(), ("whitened_resid",))


def test_residual_gl_preserves_logits_and_whitened_scores_but_not_frobenius():
    model = random_model(n_layers=2, n_heads=2)
    transformed = residual_transform(model, random_gl(model.shape.d_model))
    tokens = torch.randint(0, 11, (4, 17))
    torch.testing.assert_close(transformed(tokens), model(tokens), rtol=1e-4, atol=1e-5)  # same function
    probe = ProbeBatch(tokens=tokens, n=8, first_start=1)
    measures = ("frobenius", "whitened", "whitened_resid")
    options = {"measures": list(measures), "baseline_samples": 50}
    before = take_snapshot(model, probe, composition=options, dtype=torch.float64)["composition"].scores
    after = take_snapshot(transformed, probe, composition=options, dtype=torch.float64)["composition"].scores
    for kind in "QKV":
        valid = ~before["whitened"][kind].isnan()
        for whitened in ("whitened", "whitened_resid"):
            torch.testing.assert_close(after[whitened][kind][valid], before[whitened][kind][valid], rtol=1e-4, atol=0)
        change = (after["frobenius"][kind][valid] - before["frobenius"][kind][valid]).abs().max()
        assert change > 1e-2, kind  # the plain ratio is not invariant


def test_residual_rotation_leaves_frobenius_unchanged():
    model = random_model(n_layers=2, n_heads=2)
    rotation = torch.linalg.qr(torch.randn(model.shape.d_model, model.shape.d_model)).Q
    before = composition_scores(head_circuits(model, torch.float64), frobenius_ratio)["frobenius"]["K"]
    after = composition_scores(head_circuits(residual_transform(model, rotation), torch.float64), frobenius_ratio)[
        "frobenius"
    ]["K"]
    valid = ~before.isnan()
    torch.testing.assert_close(after[valid], before[valid], rtol=1e-4, atol=0)


def test_with_shortformer_positions_the_embedding_covariance_is_the_tokens_alone():
    """Under shortformer the stream layer 0 reads holds no position (docs/measures.md, "Biases and
    shortformer positions"): the covariance whitened by ``whitened`` is that of ``W_E``'s rows."""
    from metrics.composition.whitening import embedding_covariance
    from tests.helpers import easytransformer_like

    for positions in ("standard", "shortformer"):
        model = easytransformer_like(positions, True)
        rows = (
            model.W_E.detach()
            if positions == "shortformer"
            else (model.W_E[:, None] + model.W_pos[None]).detach().flatten(0, 1)
        )
        centred = rows - rows.mean(0)
        torch.testing.assert_close(embedding_covariance(model), centred.T @ centred / len(rows), rtol=1e-10, atol=1e-12)


def test_a_snapshot_of_a_model_with_seed_002s_options_has_every_part():
    from data.probe import make_probe_batch
    from metrics.composition.measures import WEIGHT_MEASURES
    from metrics.snapshot import take_snapshot
    from tests.helpers import easytransformer_like

    model = easytransformer_like("shortformer", True, "layernorm")
    composition = {"measures": list(WEIGHT_MEASURES), "baseline_samples": 200}
    snap = take_snapshot(
        model, make_probe_batch(0, 4, 4, 10), composition=composition, ablation=True, writes=True, dtype=torch.float64
    )
    assert all(snap.get(name) is not None for name in ("ablation", "validity", "writes"))
    assert all(torch.isfinite(snap["composition"].scores[m]["K"][0, :, 1]).all() for m in WEIGHT_MEASURES)
