"""The all-pairs engine against the engine it replaced (per-pair stacks, ``tests/reference_engine.py``),
chunked or not, and its float32 path against float64."""

from __future__ import annotations

import pytest
import torch

from data.probe import make_probe_batch
from metrics.composition.circuits import HeadCircuits, LowRank, head_circuits
from metrics.composition.engine import (
    all_pair_stats,
    composition_flops,
    composition_scores,
    gram_blocks,
    gram_frobenius,
    head_spectra,
    uses_gram_products,
)
from metrics.composition.measures import WEIGHT_MEASURES
from metrics.composition.scores import composition_of
from metrics.composition.whitening import embedding_covariance, residual_covariance, symmetric_powers
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests import reference_engine as old
from tests.helpers import random_model

RAW = [m for m, measure in WEIGHT_MEASURES.items() if measure.basis == "raw"]
FLOAT32_TOLERANCE = 2e-4  # relative, on random weights (measured max ~1e-5; see test_float32_agrees_with_float64)


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_new_engine_equals_old_engine(normalization):
    model = random_model(normalization, n_layers=3, n_heads=3).double()
    new = composition_scores(head_circuits(model), tuple(WEIGHT_MEASURES[m] for m in RAW))
    circuits = old.head_circuits(model)
    assert set(old.OLD_MEASURES) <= set(RAW)
    for name in old.OLD_MEASURES:  # a measure added since has its own reference
        want = old.composition_scores(circuits, old.OLD_MEASURES[name])
        for kind in "QKV":
            torch.testing.assert_close(
                new[name][kind], want[kind], rtol=1e-9, atol=1e-12, equal_nan=True, msg=f"{name} {kind}"
            )


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_whitened_measures_equal_old_engine(normalization):
    model = random_model(normalization, n_layers=3, n_heads=2).double()
    tokens = make_probe_batch(0, 4, 5, 10).tokens
    residual = model.run_with_cache(tokens)[1]["resid_pre"]
    new = composition_of(model, ("whitened", "whitened_resid"), residual=residual)
    for name, covariance in (
        ("whitened", embedding_covariance(model)),
        ("whitened_resid", residual_covariance(residual, norm=model.final_norm)),
    ):
        want = old.composition_scores(
            old.whiten(old.head_circuits(model), *symmetric_powers(covariance)), old.frobenius_ratio
        )
        for kind in "QKV":
            torch.testing.assert_close(
                new[name][kind], want[kind], rtol=1e-9, atol=1e-12, equal_nan=True, msg=f"{name} {kind}"
            )


def test_chunking_changes_nothing():
    """A chunk budget that fits one writer at a time gives bit-for-bit the same pair statistics' scores."""
    model = random_model(n_layers=4, n_heads=3).double()
    measures = tuple(WEIGHT_MEASURES[m] for m in RAW)
    whole = composition_scores(head_circuits(model), measures)
    one_writer = composition_scores(head_circuits(model), measures, max_chunk_bytes=1)
    for name in RAW:
        for kind in "QKV":
            torch.testing.assert_close(one_writer[name][kind], whole[name][kind], rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
@pytest.mark.parametrize(
    "max_chunk_bytes", [256 * 2**20, 100_000, 1], ids=["whole", "two-layer-groups", "one-head-chunks"]
)
def test_gram_frobenius_equals_the_cosines_path(normalization, max_chunk_bytes):
    # (d_model 24 is one Gram block; test_gram_blocks_tile_the_upper_triangle covers the cut)
    """The Gram-matrix Frobenius ratio (the path a Frobenius-only call takes when d_model < d_head²)
    equals the one computed from the pairs' cosines, every pair and kind, chunked or not; its float32
    path agrees with float64 within the engine's float32 tolerance."""
    model = random_model(normalization, n_layers=4, n_heads=3).double()
    circuits = head_circuits(model)
    assert uses_gram_products(24, 5)  # random_model's d_model, d_head
    kinds = ("Q", "K", "V")
    stats = all_pair_stats(*head_spectra(circuits), 4, 3)
    want = WEIGHT_MEASURES["frobenius"].score(stats).reshape(3, 4, 3, 4, 3)
    got = gram_frobenius(circuits, kinds, max_chunk_bytes).reshape(3, 4, 3, 4, 3)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, equal_nan=True)
    single = gram_frobenius(head_circuits(model.float()), kinds, max_chunk_bytes).reshape(3, 4, 3, 4, 3)
    torch.testing.assert_close(single.double(), want, rtol=FLOAT32_TOLERANCE, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("d_model", [64, 200, 768, 1001])
def test_gram_blocks_tile_the_upper_triangle(d_model):
    """Counting the off-diagonal blocks twice, the blocks cover every entry of a d x d matrix once."""
    cover = torch.zeros(d_model, d_model, dtype=torch.int64)
    for rows, cols in gram_blocks(d_model):
        cover[rows, cols] += 1
        if rows != cols:
            cover[cols, rows] += 1
    assert (cover == 1).all()


def test_gram_frobenius_with_blocks_and_leading_dims_equals_a_dense_reference():
    """At d_model 400 (two blocks) and two stacked bases, the Gram path equals ‖A B‖ / (‖A‖ ‖B‖)
    computed from the dense matrices, for every kind of a pair, and is NaN where the layer order forbids."""
    torch.manual_seed(0)
    L, H, d, r = 2, 2, 400, 21
    qk_l, qk_r, ov_l, ov_r = (torch.randn(2, L, H, d, r, dtype=torch.float64) for _ in range(4))
    circuits = HeadCircuits(LowRank(qk_l, qk_r), LowRank(ov_l, ov_r))
    got = gram_frobenius(circuits, ("Q", "K", "V"), max_chunk_bytes=1)  # (2, 3, 4, 4), writers re-formed per layer
    ratio = lambda A, B: torch.linalg.matrix_norm(A @ B) / (torch.linalg.matrix_norm(A) * torch.linalg.matrix_norm(B))
    for basis in range(2):
        for w in range(2):
            A = ov_l[basis, 0, w] @ ov_r[basis, 0, w].T
            for h in range(2):
                W_QK, W_OV = qk_l[basis, 1, h] @ qk_r[basis, 1, h].T, ov_l[basis, 1, h] @ ov_r[basis, 1, h].T
                for k, B in enumerate((W_QK, W_QK.T, W_OV)):
                    torch.testing.assert_close(got[basis, k, w, 2 + h], ratio(A, B), rtol=1e-10, atol=0)
    assert got[:, :, 2:, :].isnan().all() and got[:, :, :, :2].isnan().all()


def test_pair_stats_are_masked_by_layer_order_and_sum_correctly():
    """Σ_i row_energy_i weighted by σ_A² is ‖A B‖², checked against the dense product for one pair."""
    model = random_model(n_layers=3, n_heads=2).double()
    circuits = head_circuits(model)
    writer, readers = head_spectra(circuits)
    stats = all_pair_stats(writer, readers, 3, 2, cosine_mass=True)
    energy = stats.product_energy()[1]  # (n, n) of kind K, the second of Q, K, V
    layer = torch.arange(3).repeat_interleave(2)
    later = layer[:, None] < layer[None, :]
    assert energy[later].isfinite().all() and energy[~later].isnan().all()
    ov = circuits.ov.flatten_heads().dense()  # (n, d, d)
    qk = circuits.qk.flatten_heads().dense()
    want = torch.linalg.matrix_norm(ov[1] @ qk[4].T).square()  # L0H1 -> L2H0, K: W_OV¹ W_QK²ᵀ
    torch.testing.assert_close(energy[1, 4], want, rtol=1e-10, atol=0)
    mass = stats.cosine_mass[1]
    assert ((mass[later] >= 0) & (mass[later] <= model.shape.d_head + 1e-9)).all()


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_float32_agrees_with_float64(normalization):
    model = random_model(normalization, n_layers=3, n_heads=3)
    tokens = make_probe_batch(0, 4, 5, 10).tokens
    residual = model.run_with_cache(tokens)[1]["resid_pre"]
    # random_model has d_vocab 11 < d_model 24: its token Gram W_Eᵀ W_E is singular, and token_space
    # there depends on how the null directions are regularised (eps differs by dtype); see the full-rank case below
    names = tuple(m for m in WEIGHT_MEASURES if m != "token_space")
    whitenings = {}
    single = composition_of(model, names, residual=residual)
    double = composition_of(model, names, residual=residual, dtype=torch.float64, whitenings=whitenings)
    for name in names:
        # a whitened basis loses κ(Σ)·eps to rounding (7e3·eps for this LayerNorm model's embeddings)
        basis = WEIGHT_MEASURES[name].basis
        rounding = 0.0 if basis == "raw" else whitenings[basis].condition * torch.finfo(torch.float32).eps
        for kind in "QKV":
            assert single[name][kind].dtype == torch.float32 and double[name][kind].dtype == torch.float64
            torch.testing.assert_close(
                single[name][kind].double(),
                double[name][kind],
                rtol=max(FLOAT32_TOLERANCE, rounding),
                atol=1e-6,
                equal_nan=True,
                msg=f"{name} {kind}",
            )


def test_float32_token_space_agrees_with_float64_where_the_token_gram_has_full_rank():
    torch.manual_seed(0)
    model = AttentionOnlyTransformer(
        TransformerShape(n_layers=3, n_heads=3, d_model=24, d_head=5, n_ctx=17, d_vocab=50)
    )
    single = composition_of(model, ("token_space",))["token_space"]
    double = composition_of(model, ("token_space",), dtype=torch.float64)["token_space"]
    for kind in "QKV":
        torch.testing.assert_close(
            single[kind].double(), double[kind], rtol=FLOAT32_TOLERANCE, atol=1e-6, equal_nan=True, msg=kind
        )


def test_flop_count_is_the_pair_gemms():
    # 2 layers x 2 heads: one reader layer, 2 writers x 2 readers x 3 kinds, each a d_head x d_model x d_head block
    assert composition_flops(2, 2, 64, 16, ["frobenius", "sv_bound"]) == 2 * (2 * 16) * 64 * (3 * 2 * 16)
    # Frobenius alone goes through Grams: 2 writers' and 3 kinds x 2 readers' d_model x d_model Grams of
    # rank d_head (one block at d_model 64), then 2 writers x 6 readers dot products of them
    grams = 2 * 64 * 64 * 16 * (2 + 3 * 2) + 2 * 64 * 64 * 3 * 2 * 2
    assert composition_flops(2, 2, 64, 16, ["frobenius"]) == grams
    # a whitened basis adds its own pair products and the whitening of 4 weights per head
    both = composition_flops(2, 2, 64, 16, ["frobenius", "whitened"])
    assert both == 2 * grams + 2 * 64 * 64 * 16 * 4 * 4
    # stacked with a measure that needs the cosines, both bases go through the cosines
    mixed = composition_flops(2, 2, 64, 16, ["sv_bound", "whitened"])
    assert mixed == 2 * composition_flops(2, 2, 64, 16, ["sv_bound"]) + 2 * 64 * 64 * 16 * 4 * 4
    # an ill-conditioned whitened basis goes through the cosines; the raw one keeps the Grams
    assert composition_flops(2, 2, 64, 16, ["whitened"], well_conditioned=False) == mixed - composition_flops(
        2, 2, 64, 16, ["sv_bound"]
    )
    # where d_model >= d_head², cosines are cheaper and Frobenius goes through them too
    assert composition_flops(2, 2, 64, 8, ["frobenius"]) == 2 * (2 * 8) * 64 * (3 * 2 * 8)
