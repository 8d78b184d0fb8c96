"""Every group's refined LLC, sampled as one batch, against devinterp's ``sample`` with that group's
``param_masks``, chain by chain and draw by draw (float64: the same noise, so equal to rounding), and
against :func:`~metrics.dynamics.llc.estimate_llc` and ``llc_record`` as the product calls them (float32)."""

from __future__ import annotations

import contextlib
import gc
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from metrics.dynamics.llc import SGLDSettings, head_masks, llc_record
from metrics.dynamics.refined_llc import (
    GROUP_KINDS,
    batched_sgld,
    group_masks,
    group_names,
    refined_estimates,
    refined_llcs,
    step_flops,
)
from models.interventions import HeadChange
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import random_model, require_extra

require_extra("devinterp", "llc")

SETTINGS = SGLDSettings(
    lr=1e-3, n_beta=16 / math.log(16), localization=100.0, chains=2, draws=12, burnin=3, batch_size=16, seed=5
)
"""Short chains (15 steps, the draws on 3 batches cycled) at the product's ε and γ."""

SHAPES = {
    "plain": dict(normalization="none", positions="standard", biases=False),
    "biases, layernorm, shortformer": dict(normalization="layernorm", positions="shortformer", biases=True),
}


def small_model(options: dict, seed: int = 3) -> AttentionOnlyTransformer:
    """2 layers × 2 heads, d_model 24, d_head 5, vocabulary 11, float64; biases and gains not at their init."""
    torch.manual_seed(seed)
    shape = TransformerShape(n_layers=2, n_heads=2, d_model=24, d_head=5, n_ctx=17, d_vocab=11, **options)
    model = AttentionOnlyTransformer(shape).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("b_") or name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def random_rows(count: int = 3 * 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 11, (count, 17), generator=torch.Generator().manual_seed(seed))


def repeated_rows(count: int = 3 * 16, seed: int = 2) -> torch.Tensor:
    """Another distribution: 8 random tokens, then the same 8 again (an induction task's sequences)."""
    half = torch.randint(0, 11, (count, 8), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half[:, :1], half, half], dim=1)


def float64_loss(model, tokens):
    logits = model(tokens)[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view(tokens.shape[0], -1)


def devinterp_trace(model, rows, settings: SGLDSettings, masks) -> torch.Tensor:
    """``nβ (L_B(w_t) − L_B(w*)) [chains, draws]`` of devinterp's own chains (``sample`` with ``masks``), from
    the float64 losses its chains evaluate (devinterp stores them in float32), against ``L_j(w*)`` in float64."""
    from datasets import Dataset
    from devinterp.slt.sampling import sample

    seen = []

    def recording_loss(sampled, tokens):
        per_token = float64_loss(sampled, tokens)
        if torch.is_grad_enabled():  # a chain's step (its init loss is taken without gradients)
            seen.append(per_token.detach().mean())
        return per_token

    batches = rows.shape[0] // settings.batch_size
    gc.freeze()  # devinterp collects around every chain: not the test session's objects again (0.4 s a call)
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sample(
                model=model,
                dataset=Dataset.from_dict({"input_ids": rows.numpy()}).with_format("torch"),
                observables={},
                param_masks=masks,
                lr=settings.lr,
                n_beta=settings.n_beta,
                localization=settings.localization,
                num_chains=settings.chains,
                num_draws=settings.draws,
                num_burnin_steps=settings.burnin,
                batch_size=settings.batch_size,
                num_init_loss_batches=batches,
                shuffle=False,
                init_seed=settings.seed,
                loss_fn=recording_loss,
                device="cpu",
            )
    finally:
        gc.unfreeze()
    steps = settings.burnin + settings.draws
    drawn = torch.stack(seen).view(settings.chains, steps)[:, settings.burnin :]
    with torch.no_grad():
        reference = torch.stack([float64_loss(model, chunk).mean() for chunk in rows.split(settings.batch_size)])
    batch_of_draw = (settings.burnin + torch.arange(settings.draws)) % batches
    return settings.n_beta * (drawn - reference[batch_of_draw])


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


FLOAT64_AGREEMENT = 1e-12
"""Batched chains against devinterp's in float64: measured at most 1.2e-14 (0 without a normalization; the
layernorm-shortformer-bias shape's norm and bias sums round in another order), held at 1e-12 so that
another machine's BLAS may round differently, far below what a wrong mask, seed or update would give."""


@pytest.mark.parametrize("options", SHAPES.values(), ids=SHAPES.keys())
def test_every_group_is_devinterps_chain_draw_for_draw(options):
    """Each head, each layer and the whole model against devinterp's ``sample`` with its masks, in float64:
    the batched chains draw devinterp's noise, so every draw agrees to rounding (:data:`FLOAT64_AGREEMENT`)."""
    model = small_model(options)
    rows = random_rows()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ours = refined_estimates(model, rows, SETTINGS)
    assert list(ours) == ["L0H0", "L0H1", "L1H0", "L1H1", "L0", "L1", "model"]
    for name, estimate in ours.items():
        theirs = devinterp_trace(model, rows, SETTINGS, group_masks(model, name))
        assert estimate.trace.dtype == torch.float64 and estimate.trace.shape == theirs.shape
        assert relative_error(estimate.trace, theirs) < FLOAT64_AGREEMENT, name
        assert estimate.mean == pytest.approx(float(theirs.mean()), rel=FLOAT64_AGREEMENT), name
        assert estimate.per_chain == pytest.approx(theirs.mean(dim=1).tolist(), rel=FLOAT64_AGREEMENT, abs=1e-15), name
    traces = [estimate.trace for estimate in ours.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(traces) for b in traces[i + 1 :])  # seven samplers
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # left as it was


def test_the_data_refined_llc_is_the_same_sampler_on_another_distributions_rows():
    """Wang et al.'s data-refined LLC: the loss (and SGLD's gradient) on another distribution's sequences."""
    model = small_model(SHAPES["plain"])
    training, other = random_rows(), repeated_rows()
    groups = ["L1H1", "model"]
    weight_refined = refined_estimates(model, training, SETTINGS, groups)
    data_refined = refined_estimates(model, other, SETTINGS, groups)
    for name in groups:
        theirs = devinterp_trace(model, other, SETTINGS, group_masks(model, name))
        assert relative_error(data_refined[name].trace, theirs) < FLOAT64_AGREEMENT, name
        assert not torch.allclose(data_refined[name].trace, weight_refined[name].trace, rtol=0.01)


def test_as_the_product_runs_it_every_head_and_the_model_equal_estimate_llc():
    """float32, the product's loss and reduction: llc_record (devinterp, one estimate a group) against
    the batched records. The noise is the same, so they differ by float32 rounding alone: within the
    trace's own float32 resolution, nβ · eps32 · L(w*) (1.7e-6 here; measured 2.9-4.5e-7 on a 2-core x86
    machine, where batched and one-chain GEMMs round differently, and 0 on the machine the test was written on)."""
    model = random_model(n_layers=2, n_heads=2, seed=3)
    rows = random_rows(4 * 16)
    settings = SGLDSettings(
        lr=1e-3, n_beta=16 / math.log(16), localization=100.0, chains=3, draws=30, burnin=5, batch_size=16
    )
    ours = refined_llcs(model, rows, settings, 0.1, ["heads", "model"])
    assert list(ours) == ["L0H0", "L0H1", "L1H0", "L1H1", "model"]
    for name, record in ours.items():
        masks = None if name == "model" else head_masks(model, int(name[1]), int(name[3]))
        theirs = llc_record(model, rows, settings, 0.1, masks)
        assert set(record) == set(theirs)
        assert record["diverged"] == theirs["diverged"] == 0 and record["settled"] == theirs["settled"]
        assert record["init_loss"] == pytest.approx(theirs["init_loss"], rel=1e-6)
        chains = [f"chain_{i}" for i in range(settings.chains)]
        resolution = settings.n_beta * torch.finfo(torch.float32).eps * theirs["init_loss"]
        assert record["mean"] == pytest.approx(theirs["mean"], rel=1e-5, abs=resolution), name
        assert [record[c] for c in chains] == pytest.approx([theirs[c] for c in chains], rel=1e-5, abs=resolution), name
        assert record["std"] == pytest.approx(theirs["std"], rel=1e-4, abs=resolution), name


@pytest.mark.filterwarnings("ignore:Chain failed")  # devinterp's, for its own diverged chains
def test_a_diverged_chain_makes_its_groups_record_nan_and_leaves_the_others_alone():
    """ε γ > 4: the localization alone overshoots and grows (1 − εγ/2)^t until the loss overflows."""
    model = random_model(n_layers=2, n_heads=2, seed=3)
    rows = random_rows()
    unstable = SGLDSettings(lr=1.0, n_beta=4.0, localization=100.0, chains=2, draws=40, burnin=0, batch_size=16)
    still = {"layers.0.W_Q": torch.zeros_like(model.layers[0].W_Q)}  # moves nothing
    draws = batched_sgld(model, rows, unstable, [still, head_masks(model, 1, 0)])
    assert draws.finite.tolist() == [[True, True], [False, False]]
    batch_of_draw = torch.arange(unstable.draws) % 3
    torch.testing.assert_close(draws.losses[0], draws.reference[batch_of_draw].expand(2, -1))  # at w* throughout
    records = refined_llcs(model, rows, unstable, 0.1, ["L1H0"])
    assert records["L1H0"]["diverged"] == 1 and math.isnan(records["L1H0"]["mean"])
    assert math.isnan(records["L1H0"]["chain_1"]) and records["L1H0"]["settled"] == 0
    assert llc_record(model, rows, unstable, 0.1, head_masks(model, 1, 0))["diverged"] == 1  # as devinterp's


def test_groups_are_named_as_heads_are():
    model = random_model(n_layers=2, n_heads=3, seed=0)
    assert group_names(model.shape) == [*(f"L{l}H{h}" for l in range(2) for h in range(3)), "L0", "L1", "model"]
    assert group_names(model.shape, ["L1H2", "layers", "L0"]) == ["L1H2", "L0", "L1"]
    assert GROUP_KINDS == ("heads", "layers", "model")
    assert group_masks(model, "model") == {name: None for name, _ in model.named_parameters()}
    assert group_masks(model, "L1") == {f"layers.1.W_{m}": None for m in "QKVO"}
    head = group_masks(model, "L1H2")
    assert set(head) == {f"layers.1.W_{m}" for m in "QKVO"} and all(m[2].eq(1).all() for m in head.values())
    for bad, message in (("L2H0", "2 layers"), ("L0H3", "3 heads"), ("L0K1", "unknown group"), ("L5", "2 layers")):
        with pytest.raises(ValueError, match=message):
            group_masks(model, bad)
    with pytest.raises(ValueError, match="whole number of batches"):
        refined_estimates(model, random_rows(20), SETTINGS)


@pytest.mark.parametrize("options", SHAPES.values(), ids=SHAPES.keys())
def test_under_an_intervention_heads_layers_and_the_model_are_devinterps_chains(options):
    """A model with a head ablated (mean over the batch: what a member reads is its own batch) and a head's
    temperature changed: the sampled members run the single model's explicit patterns with its changes,
    from the first layer they move, and equal devinterp's chains on that model in float64."""
    model = small_model(options)
    model.set_changes(
        {0: [HeadChange(head=1, kind="temperature", factor=0.5)], 1: [HeadChange(0, "ablate", replacement="mean")]}
    )
    rows = random_rows()
    groups = ["L0H0", "L1H1", "L1", "model"]
    ours = refined_estimates(model, rows, SETTINGS, groups)
    for name in groups:
        theirs = devinterp_trace(model, rows, SETTINGS, group_masks(model, name))
        assert relative_error(ours[name].trace, theirs) < FLOAT64_AGREEMENT, name


@pytest.mark.parametrize(
    "groups, attentions",
    [
        (["L1H0"], 2 + 2 * 2),
        (["L0H1"], 3 + 2 * 3),
        (["L2"], 1 + 2),
        (["model"], 3 + 2 * 3),
        (["L1H0", "L2H1"], (2 + 2 * 2) + (1 + 2)),
    ],
)
def test_step_flops_count_what_the_sampler_multiplies(groups, attentions):
    """torch's FLOP counter on a whole :func:`batched_sgld` run (one chain, 3 steps on one batch) of a 3-layer
    model: one forward pass of ``w*`` (the reference losses and the streams entering each group's first moving
    layer), then every step each member's forward and backward from that layer on. The counter does not count
    the CPU's fused attention, so that is added by hand: the ``w*`` pass's 3 layers, and per step each group's
    layers forward and 2 GEMMs a layer backward (``attentions``, summed over the groups)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = random_model(n_layers=3, n_heads=2, seed=0)
    rows = torch.randint(0, 11, (4, 17), generator=torch.Generator().manual_seed(0))
    settings = SGLDSettings(lr=1e-3, n_beta=2.0, localization=100.0, chains=1, draws=3, burnin=0, batch_size=4)
    masks = [group_masks(model, group) for group in groups]
    with FlopCounterMode(display=False) as counter:
        draws = batched_sgld(model, rows, settings, masks)
    shape = model.shape
    attention = 2 * 2 * 4 * shape.n_heads * 17 * 17 * shape.d_head  # scores and mixing, one member
    assert counter.get_total_flops() + (3 + 3 * attentions) * attention == draws.flops
    projection, unembedding = (
        2 * 4 * 17 * shape.d_model * shape.n_heads * shape.d_head,
        2 * 4 * 16 * shape.d_model * shape.d_vocab,
    )
    w_star = 3 * (4 * projection + attention) + unembedding
    assert draws.flops == w_star + 3 * sum(step_flops(shape, 4, 17, mask) for mask in masks)


def test_a_head_ablated_to_zero_is_sampled_as_devinterp_samples_it():
    """A head whose output is replaced by zero (``intervention=ablate``, as a run whose induction heads are
    prevented trains) has no gradient at all: its own chains, its layer's and the model's move it by the
    localization and the noise alone, as devinterp's SGLD does with a missing gradient (float64, draw
    for draw)."""
    model = small_model(next(iter(SHAPES.values())))
    model.set_changes({1: [HeadChange(0, "ablate", replacement="zero")]})
    rows = random_rows()
    groups = ["L1H0", "L1", "model"]
    ours = refined_estimates(model, rows, SETTINGS, groups)
    assert torch.equal(ours["L1H0"].trace, torch.zeros_like(ours["L1H0"].trace))  # the loss does not see it: λ̂ 0
    for name in groups:
        theirs = devinterp_trace(model, rows, SETTINGS, group_masks(model, name))
        worst = float((ours[name].trace - theirs).abs().max())
        assert worst <= FLOAT64_AGREEMENT * float(theirs.abs().max()), name  # L1H0's: 0 and 0
