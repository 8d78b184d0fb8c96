"""The token-space ratio (docs/measures.md measure 7): a whitened ratio whose Σ is the token embeddings'
uncentred Gram matrix ``G = W_Eᵀ W_E``, checked against dense ``[d_vocab, d_vocab]`` token-to-token maps,
and its invariance to residual GL transforms (where Frobenius changes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.reparametrize import residual_transform
from metrics.composition.measures import WEIGHT_MEASURES
from metrics.composition.scores import basis_whitening, composition_of
from metrics.composition.whitening import embedding_covariance, symmetric_powers, token_gram
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import dense_reader_factors, hand_centre, hand_fold

SHAPE = TransformerShape(n_layers=3, n_heads=2, d_model=16, d_head=4, n_ctx=9, d_vocab=40)


def small_model(normalization: str = "none", seed: int = 0) -> AttentionOnlyTransformer:
    """3 layers x 2 heads, d_model 16, d_vocab 40 (W_E has full column rank), float64; random gains."""
    torch.manual_seed(seed)
    model = AttentionOnlyTransformer(dataclasses.replace(SHAPE, normalization=normalization)).double()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
                module.weight.copy_(0.5 + torch.rand_like(module.weight))
    return model


def norm(X: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(X).item()


def test_token_space_is_registered_after_whitened_resid_in_the_token_basis():
    names = list(WEIGHT_MEASURES)
    assert names.index("token_space") == names.index("whitened_resid") + 1
    assert WEIGHT_MEASURES["token_space"].basis == "token"
    assert WEIGHT_MEASURES["token_space"].score is WEIGHT_MEASURES["whitened"].score


def test_token_gram_is_the_uncentred_mean_second_moment_of_the_token_embeddings():
    model = small_model()
    W_E = model.W_E.detach()
    torch.testing.assert_close(token_gram(model, torch.float64), W_E.T @ W_E / SHAPE.d_vocab, rtol=1e-12, atol=0)
    # not the covariance `whitened` uses: that one is centred and adds the positions'
    assert (token_gram(model, torch.float64) - embedding_covariance(model, torch.float64)).abs().max() > 1e-2


def test_token_basis_needs_no_residual_stream_and_unknown_bases_are_refused():
    model = small_model()
    basis_whitening(model, "token", None, torch.float64)  # the embeddings are enough
    with pytest.raises(ValueError, match="unknown residual basis"):
        basis_whitening(model, "tokens", None, torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_norm_is_a_whitened_norm(seed):
    """‖W_E X W_Eᵀ‖_F = ‖G^½ X G^½‖_F with G = W_Eᵀ W_E, for any X (W_E of any rank), and
    ‖W_E X W_E⁺‖_F = ‖G^½ X G^-½‖_F when W_E has full column rank."""
    g = torch.Generator().manual_seed(seed)
    W_E = torch.randn(40, 16, generator=g, dtype=torch.float64)
    X = torch.randn(16, 16, generator=g, dtype=torch.float64)
    half, inverse_half = symmetric_powers(W_E.T @ W_E)
    assert norm(W_E @ X @ W_E.T) == pytest.approx(norm(half @ X @ half), rel=1e-12)
    assert norm(W_E @ X @ torch.linalg.pinv(W_E)) == pytest.approx(norm(half @ X @ inverse_half), rel=1e-12)
    # the first identity needs no rank: W_E of rank 6
    low = torch.randn(40, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 16, generator=g, dtype=torch.float64)
    G = low.T @ low
    values, vectors = torch.linalg.eigh(G)
    root = (vectors * values.clamp_min(0).sqrt()) @ vectors.T
    assert norm(low @ X @ low.T) == pytest.approx(norm(root @ X @ root), rel=1e-9)


def dense_token_ratio(model, l1, h1, l2, h2, kind) -> float:
    """The Frobenius ratio of the token-to-token maps ``[d_vocab, d_vocab]``: the reading side of a form
    in token coordinates is ``W_E`` (a token's embedding read), its writing side ``W_E⁺`` (a write
    expressed as a least-squares mix of token embeddings). Writer ``A = W_OV¹`` -> ``W_E A W_E⁺``;
    readers ``W_QK²`` (Q), ``W_QK²ᵀ`` (K) -> ``W_E B W_Eᵀ``, ``W_OV²`` (V) -> ``W_E B W_E⁺``; the
    products ``W_E A B W_Eᵀ`` (Q, K) and ``W_E A B W_E⁺`` (V). Under LayerNorm the writers are centred,
    ``W_E`` too: its pseudo-inverse then mixes centred embeddings, rank ``d_model - 1``."""
    W_E = hand_centre(model.final_norm, model.W_E)
    W_E_plus = torch.linalg.pinv(W_E)
    writer = model.layers[l1]
    A = hand_fold(writer.norm, writer.W_V[h1]) @ hand_centre(writer.norm, writer.W_O[h1])
    _, B = dense_reader_factors(model, l2, h2, kind)
    out = W_E_plus if kind == "V" else W_E.T
    A_tok, B_tok, AB_tok = W_E @ A @ W_E_plus, W_E @ B @ out, W_E @ A @ B @ out
    assert AB_tok.shape == (SHAPE.d_vocab, SHAPE.d_vocab)
    return norm(AB_tok) / (norm(A_tok) * norm(B_tok))


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_token_space_matches_the_dense_token_to_token_ratio(normalization, kind):
    model = small_model(normalization)
    got = composition_of(model, ("token_space",), dtype=torch.float64)["token_space"][kind]
    pairs = (~got.isnan()).nonzero().tolist()
    assert len(pairs) == 3 * SHAPE.n_heads**2  # every layer-ordered pair of 3 layers x 2 heads
    for l1, h1, l2, h2 in pairs:
        want = dense_token_ratio(model, l1, h1, l2, h2, kind)
        assert got[l1, h1, l2, h2].item() == pytest.approx(want, rel=1e-9), (l1, h1, l2, h2)


def test_token_space_differs_from_whitened():
    """Same score, another Σ: uncentred, tokens only, no positions."""
    model = small_model()
    got = composition_of(model, ("whitened", "token_space"), dtype=torch.float64)
    for kind in "QKV":
        valid = ~got["whitened"][kind].isnan()
        assert (got["token_space"][kind][valid] - got["whitened"][kind][valid]).abs().max() > 1e-3, kind


def test_residual_gl_leaves_token_space_unchanged_but_not_frobenius():
    model = small_model()
    g = torch.Generator().manual_seed(3)
    d = SHAPE.d_model
    T = torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5 + torch.eye(
        d, dtype=torch.float64
    )  # far from orthogonal
    transformed = residual_transform(model, T)
    tokens = torch.randint(0, SHAPE.d_vocab, (3, SHAPE.n_ctx), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(transformed(tokens), model(tokens), rtol=1e-9, atol=1e-9)  # the same function
    measures = ("frobenius", "token_space")
    before = composition_of(model, measures, dtype=torch.float64)
    after = composition_of(transformed, measures, dtype=torch.float64)
    for kind in "QKV":
        valid = ~before["token_space"][kind].isnan()
        torch.testing.assert_close(
            after["token_space"][kind][valid], before["token_space"][kind][valid], rtol=1e-8, atol=0
        )
        change = (after["frobenius"][kind][valid] - before["frobenius"][kind][valid]).abs().max()
        assert change > 1e-2, kind  # the plain ratio is not invariant


def test_a_global_scale_of_the_gram_matrix_changes_no_ratio():
    """Why dividing ``W_Eᵀ W_E`` by d_vocab is free: readers gain c on product and norm alike."""
    model = small_model()
    whitening = basis_whitening(model, "token", None, torch.float64)
    scaled = type(whitening).of(token_gram(model, torch.float64) * SHAPE.d_vocab)
    plain = composition_of(model, ("token_space",), dtype=torch.float64, whitenings={"token": whitening})["token_space"]
    raw_gram = composition_of(model, ("token_space",), dtype=torch.float64, whitenings={"token": scaled})["token_space"]
    for kind in "QKV":
        valid = ~plain[kind].isnan()
        torch.testing.assert_close(raw_gram[kind][valid], plain[kind][valid], rtol=1e-10, atol=0)


def test_the_tracker_keeps_the_token_basis_like_the_embedding_one():
    """A snapshot returns the token whitening beside the embedding one; a tracker's state_dict carries
    both, and scores computed with the kept ones equal fresh ones (the refresh policy is per basis)."""
    from data.probe import make_probe_batch
    from metrics.snapshot import measure, take_snapshot
    from metrics.tracked.composition import Composition, CompositionOptions
    from tests.helpers import tracker_of, tracker_settings

    model = small_model()
    probe = make_probe_batch(0, 4, 4, SHAPE.d_vocab - 1)
    measures = ("whitened", "token_space")
    composition = Composition(CompositionOptions(measures=list(measures), baseline_samples=50))
    snap = take_snapshot(model, probe, composition=composition, dtype=torch.float64)
    assert set(composition.whitenings) == {"embedding", "token"}
    settings = tracker_settings("measures=[whitened,token_space]", "dense_measures=[whitened,token_space]")
    tracker = tracker_of(probe, settings)
    tracker.quantity("composition").whitenings = composition.whitenings
    restored = tracker_of(probe, settings)
    restored.load_state_dict(tracker.state_dict())
    kept = restored.quantity("composition")
    torch.testing.assert_close(kept.whitenings["token"].half, composition.whitenings["token"].half, rtol=0, atol=0)
    again = measure(model, probe, [kept], step=5, last=False, dtype=torch.float64)  # between refreshes: reused
    for kind in "QKV":
        torch.testing.assert_close(
            again["composition"].scores["token_space"][kind],
            snap["composition"].scores["token_space"][kind],
            rtol=1e-12,
            atol=0,
            equal_nan=True,
        )
