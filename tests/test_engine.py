"""The all-pairs engine against the engine it replaced (per-pair stacks, ``tests/reference_engine.py``),
chunked or not, and its float32 path against float64."""

from __future__ import annotations

import pytest
import torch

from data.probe import make_probe_batch
from metrics.composition.circuits import head_circuits
from metrics.composition.engine import all_pair_stats, composition_flops, composition_scores, head_spectra
from metrics.composition.measures import COMPOSITION_MEASURES
from metrics.composition.scores import composition_of
from metrics.composition.whitening import embedding_covariance, residual_covariance, symmetric_powers
from tests import reference_engine as old
from tests.conftest import random_model

RAW = [m for m, measure in COMPOSITION_MEASURES.items() if measure.basis == "raw"]
FLOAT32_TOLERANCE = 2e-4  # relative, on random weights (measured max ~1e-5; see test_float32_agrees_with_float64)


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_new_engine_equals_old_engine(normalization):
    model = random_model(normalization, n_layers=3, n_heads=3).double()
    new = composition_scores(head_circuits(model), tuple(COMPOSITION_MEASURES[m] for m in RAW))
    circuits = old.head_circuits(model)
    for name in RAW:
        want = old.composition_scores(circuits, old.OLD_MEASURES[name])
        for kind in "QKV":
            torch.testing.assert_close(new[name][kind], want[kind], rtol=1e-9, atol=1e-12, equal_nan=True, msg=f"{name} {kind}")


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_whitened_measures_equal_old_engine(normalization):
    model = random_model(normalization, n_layers=3, n_heads=2).double()
    tokens = make_probe_batch(0, 4, 5, 10).tokens
    residual = model.run_with_cache(tokens)[1]["resid_pre"]
    new = composition_of(model, ("whitened", "whitened_resid"), residual=residual)
    for name, covariance in (("whitened", embedding_covariance(model)), ("whitened_resid", residual_covariance(residual))):
        want = old.composition_scores(old.whiten(old.head_circuits(model), *symmetric_powers(covariance)), old.frobenius_ratio)
        for kind in "QKV":
            torch.testing.assert_close(new[name][kind], want[kind], rtol=1e-9, atol=1e-12, equal_nan=True, msg=f"{name} {kind}")


def test_chunking_changes_nothing():
    """A chunk budget that fits one writer at a time gives bit-for-bit the same pair statistics' scores."""
    model = random_model(n_layers=4, n_heads=3).double()
    measures = tuple(COMPOSITION_MEASURES[m] for m in RAW)
    whole = composition_scores(head_circuits(model), measures)
    one_writer = composition_scores(head_circuits(model), measures, max_chunk_bytes=1)
    for name in RAW:
        for kind in "QKV":
            torch.testing.assert_close(one_writer[name][kind], whole[name][kind], rtol=1e-12, atol=0, equal_nan=True)


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
    names = tuple(COMPOSITION_MEASURES)
    single = composition_of(model, names, residual=residual)
    double = composition_of(model, names, residual=residual, dtype=torch.float64)
    for name in names:
        for kind in "QKV":
            assert single[name][kind].dtype == torch.float32 and double[name][kind].dtype == torch.float64
            torch.testing.assert_close(single[name][kind].double(), double[name][kind], rtol=FLOAT32_TOLERANCE, atol=1e-6,
                                       equal_nan=True, msg=f"{name} {kind}")


def test_flop_count_is_the_pair_gemms():
    # 2 layers x 2 heads: one reader layer, 2 writers x 2 readers x 3 kinds, each a d_head x d_model x d_head block
    assert composition_flops(2, 2, 64, 16, ["frobenius"]) == 2 * (2 * 16) * 64 * (3 * 2 * 16)
    # a whitened basis adds its own pair GEMMs and the whitening of 4 weights per head
    both = composition_flops(2, 2, 64, 16, ["frobenius", "whitened"])
    assert both == 2 * composition_flops(2, 2, 64, 16, ["frobenius"]) + 2 * 64 * 64 * 16 * 4 * 4
