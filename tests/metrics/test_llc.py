"""The LLC estimator against known values: d/2 for a regular model (full-rank linear regression
at its least-squares optimum), ½ Σ nβh/(nβh + γ) for a quadratic in the localized regime the
product runs, agreement between two copies of one model, and one head's LLC, whose sampling moves
nothing else."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from bench.llc_check import (
    BATCH,
    REGRESSION,
    D,
    localized_expectation,
    localized_model,
    product_settings,
    regression_loss,
    regular_model,
)
from metrics.dynamics.llc import SGLDSettings, batch_losses, estimate_llc, head_masks, per_position_losses
from tests.helpers import random_model, require_extra

require_extra("devinterp", "llc")


@pytest.fixture(scope="module")
def regression():
    return regular_model()


def test_a_regular_model_has_llc_d_over_2(regression):
    """bench.llc_check's settings (docs/results.md, "Developmental stages")."""
    model, rows = regression
    before = model.weight.detach().clone()
    estimate = estimate_llc(model, rows, REGRESSION, regression_loss)
    assert estimate.mean == pytest.approx(D / 2, rel=0.10), estimate.per_chain
    assert torch.equal(model.weight, before)  # devinterp samples a copy
    assert estimate.trace.shape == (REGRESSION.chains, REGRESSION.draws)
    assert estimate.settled(0.1) and estimate.spread < 0.2
    assert estimate.init_loss == pytest.approx(float(batch_losses(model, rows, BATCH, regression_loss).mean()))


def test_in_the_products_localized_regime_llc_is_the_localized_posteriors_expectation():
    """bench.llc_check's second case: the default stages.llc settings (ε 1e-3, nβ = 32 / ln 32, γ 100,
    4 chains × 100 draws) on a regression whose Hessian spans the default model's, against the
    exact E[λ̂] of the localized posterior (docs/results.md, "The estimator where it is used")."""
    model, rows, h = localized_model()
    settings = product_settings()
    assert settings.localization > 0 and settings.n_beta == pytest.approx(32 / math.log(32))
    exact = localized_expectation(h, settings)
    assert exact == pytest.approx(1.2306, abs=1e-3)  # ½ Σ over 10 eigenvalues in [0.1, 30]
    estimates = [
        estimate_llc(model, rows, dataclasses.replace(settings, seed=seed), regression_loss) for seed in range(3)
    ]
    assert sum(e.mean for e in estimates) / 3 == pytest.approx(exact, rel=0.10), [e.mean for e in estimates]


def test_an_unsettled_chain_is_flagged(regression):
    """ε 1e-6 relaxes over ~2000 steps: 200 draws are still climbing."""
    model, rows = regression
    slow = dataclasses.replace(REGRESSION, lr=1e-6, draws=200, burnin=0, chains=2)
    estimate = estimate_llc(model, rows, slow, regression_loss)
    assert not estimate.settled(0.1) and estimate.drift > 0.5
    assert estimate.mean < D / 2 * 0.5


@pytest.mark.slow
def test_two_copies_of_one_model_agree_within_their_spread():
    model = random_model(n_layers=2, n_heads=2, seed=3)
    tokens = torch.randint(0, 11, (8 * 16, 17), generator=torch.Generator().manual_seed(1))
    settings = SGLDSettings(
        lr=1e-3, n_beta=16 / math.log(16), localization=100.0, chains=4, draws=100, burnin=20, batch_size=16
    )
    first = estimate_llc(model, tokens, settings)
    second = estimate_llc(copy.deepcopy(model), tokens, dataclasses.replace(settings, seed=7))
    assert first.mean > 0 and second.mean > 0
    assert abs(first.mean - second.mean) <= max(first.std, second.std), (first.per_chain, second.per_chain)
    again = estimate_llc(model, tokens, settings)
    assert again.per_chain == first.per_chain  # one seed, one answer


@pytest.mark.slow
def test_one_head_alone_samples_only_its_slices():
    model = random_model(n_layers=2, n_heads=2, seed=3)
    masks = head_masks(model, 1, 0)
    assert set(masks) == {f"layers.1.W_{m}" for m in "QKVO"}
    assert all(mask[0].eq(1).all() and mask[1:].eq(0).all() for mask in masks.values())
    tokens = torch.randint(0, 11, (4 * 16, 17), generator=torch.Generator().manual_seed(1))
    settings = SGLDSettings(
        lr=1e-3, n_beta=16 / math.log(16), localization=100.0, chains=2, draws=60, burnin=10, batch_size=16
    )
    whole = estimate_llc(model, tokens, settings)
    seen = []  # every weight devinterp's sampled copy holds when a draw's loss is taken

    def recording_loss(sampled, rows):
        seen.append({name: p.detach().clone() for name, p in sampled.named_parameters()})
        return per_position_losses(sampled, rows)

    head = estimate_llc(model, tokens, settings, recording_loss, param_masks=masks)
    assert 0 < head.mean < whole.mean  # a quarter of one layer's attention weights: a smaller λ̂
    start = dict(model.named_parameters())
    assert len(seen) >= settings.chains * (settings.burnin + settings.draws)
    moved = set()
    for weights in seen:
        for name, value in weights.items():
            mask = masks.get(name, torch.zeros_like(value)).bool()
            assert torch.equal(value[~mask], start[name].detach()[~mask]), name  # every other weight exactly as it was
            if not torch.equal(value[mask], start[name].detach()[mask]):
                moved.add(name)
    assert moved == set(masks)  # and the head's own slices did move
    with pytest.raises(ValueError, match="no attention weights"):
        head_masks(model, 5, 0)


def test_per_position_losses_are_the_training_loss_per_position():
    model = random_model(n_layers=1, n_heads=2, seed=0)
    tokens = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(0))
    per_position = per_position_losses(model, tokens)
    assert per_position.shape == (3, 5)
    logits = model(tokens)
    dense = -torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(per_position, dense)


def test_a_sampled_set_must_be_whole_batches(regression):
    model, rows = regression
    with pytest.raises(ValueError, match="whole number of batches"):
        estimate_llc(model, rows[:1000], REGRESSION, regression_loss)
