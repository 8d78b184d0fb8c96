"""Attribution patching: the first-order estimate of the K-only ablation, checked against the
exact ablation it approximates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data.probe import make_probe_batch
from metrics.ground_truth.ablation import ABLATION_KINDS, ablation_cost, key_ablation_effects
from metrics.ground_truth.attribution import EXACT_MAX_FLOPS, ablation_effects, choose_method, key_attribution_effects
from metrics.ground_truth.validity import spearman
from models.transformer import TransformerShape
from tests import helpers as hand_built
from tests.helpers import PROBE, induction_circuit_model, random_model

NORMALIZATIONS = ["none", "layernorm", "rmsnorm"]


def later(effects):
    """The defined pairs (reader's layer later) of an ``[L, H, L, H]`` effect, flat."""
    return effects[~effects.isnan()]


@pytest.mark.parametrize("kind", ABLATION_KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_attribution_is_the_derivative_of_the_scaled_ablation(normalization, kind):
    """``ΔL(scale) / scale -> attribution`` as ``scale -> 0``, for every ablation kind: a one-sided
    step agrees to O(scale), a central difference to O(scale²)."""
    model = random_model(normalization, n_layers=3, n_heads=3).double().eval()
    probe = make_probe_batch(0, 6, 8, 10)
    eps = 1e-4
    estimate = later(key_attribution_effects(model, probe, kind=kind).loss_change)
    forward = later(key_ablation_effects(model, probe, scale=eps, kind=kind).loss_change)
    backward = later(key_ablation_effects(model, probe, scale=-eps, kind=kind).loss_change)
    torch.testing.assert_close(estimate, forward / eps, rtol=1e-3, atol=1e-3 * estimate.abs().max().item())
    torch.testing.assert_close(estimate, (forward - backward) / (2 * eps), rtol=1e-5, atol=0)
    assert estimate.abs().min() > 1e-7  # no pair passes for being zero on both sides


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_the_pattern_change_is_the_exact_one(normalization):
    model = random_model(normalization, n_layers=3, n_heads=2).double()
    probe = make_probe_batch(0, 4, 8, 10)
    estimate, exact = key_attribution_effects(model, probe), key_ablation_effects(model, probe)
    torch.testing.assert_close(estimate.pattern_change, exact.pattern_change, rtol=0, atol=0, equal_nan=True)


def test_attribution_ranks_the_hand_built_circuit_first(monkeypatch):
    """With softer attention (logit scale 3 instead of 30) the gradient sees the circuit: the
    K-composing pair L0H0 -> L1H0 comes first, far ahead of the distractors, as in the exact ablation."""
    monkeypatch.setattr(hand_built, "SHARP", 3.0)
    model = hand_built.induction_circuit_model()
    # pooled: with 3 probe sequences a per-position mean keeps a third of the head's own write
    exact, estimate = (
        key_ablation_effects(model, PROBE, kind="pooled"),
        key_attribution_effects(model, PROBE, kind="pooled"),
    )
    top = lambda effects: int(effects.loss_change.nan_to_num(-float("inf")).flatten().argmax())
    assert top(estimate) == top(exact) == 0 * 8 + 0 * 4 + 1 * 2 + 0  # L0H0 -> L1H0
    others = estimate.loss_change[0, :, 1, :].flatten()[1:]
    assert estimate.loss_change[0, 0, 1, 0] > 0.1 and estimate.loss_change[0, 0, 1, 0] > 100 * others.abs().max()


def test_attribution_misses_an_effect_behind_saturated_softmaxes():
    """The limit of any first-order estimate: the hand-built circuit's attention (logit scale 30)
    and predictions are saturated, so the gradient at the clean run is ~0 while the ablation
    costs 2.5 nats. The estimate cannot rank the pairs there; the exact ablation must."""
    model = induction_circuit_model()
    exact, estimate = key_ablation_effects(model, PROBE), key_attribution_effects(model, PROBE)
    print(
        f"\nhand-built L0H0 -> L1H0: exact {exact.loss_change[0, 0, 1, 0]:.3f} nats, first-order {estimate.loss_change[0, 0, 1, 0]:.1e}"
    )
    assert exact.loss_change[0, 0, 1, 0] > 1.0 and estimate.loss_change[0, 0, 1, 0].abs() < 1e-6


def test_attribution_leaves_weights_grads_mode_and_rng_alone():
    model = random_model("layernorm", n_layers=3, n_heads=2).train()
    for i, p in enumerate(model.parameters()):
        if i % 2:
            p.grad = torch.randn_like(p)  # half the parameters with a gradient, half with None
    weights, grads = (
        [p.clone() for p in model.parameters()],
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
    )
    rng = torch.get_rng_state()
    key_attribution_effects(model, make_probe_batch(0, 4, 8, 10))
    assert model.training
    assert torch.equal(rng, torch.get_rng_state())
    for p, weight, grad in zip(model.parameters(), weights, grads):
        assert torch.equal(p, weight) and p.requires_grad
        assert (p.grad is None) if grad is None else torch.equal(p.grad, grad)


def test_attribution_runs_inside_inference_mode_with_a_given_clean_run():
    model = random_model(n_layers=3, n_heads=2).eval()
    probe = make_probe_batch(0, 4, 8, 10)
    fresh = key_attribution_effects(model, probe)
    with torch.inference_mode():
        given = key_attribution_effects(model, probe, model.run_with_cache(probe.tokens))
    for name, values in given.effects().items():
        torch.testing.assert_close(values, fresh.effects()[name], equal_nan=True)


def test_attribution_takes_probe_tokens_made_under_inference_mode():
    """On a GPU the probe's tokens are copied to the device inside the snapshot's inference mode, so
    they arrive as inference tensors; the attribution's backward pass must not save them."""
    model = random_model(n_layers=3, n_heads=2).eval()
    probe = make_probe_batch(0, 4, 8, 10)
    with torch.inference_mode():
        on_device = dataclasses.replace(probe, tokens=probe.tokens.clone())
        assert on_device.tokens.is_inference()
        given = key_attribution_effects(model, on_device)
    torch.testing.assert_close(given.loss_change, key_attribution_effects(model, probe).loss_change, equal_nan=True)


def test_a_float32_model_is_attributed_in_float32_close_to_float64():
    model = random_model("rmsnorm", n_layers=3, n_heads=3).eval()
    probe = make_probe_batch(0, 6, 8, 10)
    single, double = key_attribution_effects(model, probe), key_attribution_effects(model.double(), probe)
    torch.testing.assert_close(single.loss_change, double.loss_change, rtol=1e-4, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_attribution_ranks_pairs_like_the_full_ablation(normalization):
    """Not a derivative any more: the mean ablation is a large step. Report how well the first-order
    ranking survives it on a random 3-layer, 4-head model (48 pairs)."""
    model = random_model(normalization, n_layers=3, n_heads=4).eval()
    probe = make_probe_batch(0, 8, 8, 10)
    exact, estimate = key_ablation_effects(model, probe), key_attribution_effects(model, probe)
    rho = spearman(later(estimate.loss_change), later(exact.loss_change))
    print(
        f"\n{normalization}: Spearman(attribution, exact loss change) = {rho:.3f} over {later(exact.loss_change).numel()} pairs"
    )
    assert rho > 0.3


def test_auto_is_exact_for_small_models_and_attribution_for_large_ones():
    default = TransformerShape(n_layers=2, n_heads=2, d_model=64, d_head=16, n_ctx=33, d_vocab=257)
    paper = TransformerShape(n_layers=12, n_heads=12, d_model=768, d_head=64, n_ctx=33, d_vocab=257)
    assert ablation_cost(default, 32, 33) < EXACT_MAX_FLOPS < ablation_cost(paper, 32, 33)
    assert choose_method(default, 32, 33) == "exact" and choose_method(paper, 32, 33) == "attribution"
    assert choose_method(paper, 32, 33, "exact") == "exact"
    with pytest.raises(ValueError, match="method"):
        choose_method(default, 32, 33, "fast")


def test_the_entry_point_says_which_method_it_used():
    model = random_model(n_layers=2, n_heads=2)
    probe = make_probe_batch(0, 4, 8, 10)
    exact, used = ablation_effects(model, probe)
    assert used == "exact"
    torch.testing.assert_close(exact.loss_change, key_ablation_effects(model, probe).loss_change, equal_nan=True)
    estimate, used = ablation_effects(model, probe, max_exact_flops=0)
    assert used == "attribution"
    torch.testing.assert_close(estimate.loss_change, key_attribution_effects(model, probe).loss_change, equal_nan=True)


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_attribution_with_shortformer_positions_and_biases_is_the_derivative_of_the_ablation(normalization):
    """Seed 002's library options: attribution's own forward pass (positions into the queries' and
    keys' inputs only, every bias) is the derivative of the exact ablation, which equals its loop."""
    from tests.helpers import easytransformer_like

    model = easytransformer_like("shortformer", True, normalization).eval()
    probe = make_probe_batch(0, 4, 4, 10)
    eps = 1e-4
    estimate = later(key_attribution_effects(model, probe).loss_change)
    forward = later(key_ablation_effects(model, probe, scale=eps).loss_change)
    backward = later(key_ablation_effects(model, probe, scale=-eps).loss_change)
    torch.testing.assert_close(estimate, (forward - backward) / (2 * eps), rtol=1e-5, atol=0)
    assert estimate.abs().min() > 1e-9
