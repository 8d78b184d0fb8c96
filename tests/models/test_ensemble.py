"""The stacked model, its optimizer and its clipping against the single model's, member by member
(float64: the references are torch's own AdamW, LambdaLR and clip_grad_norm_ on separate models)."""

from __future__ import annotations

import pytest
import torch

from models.ensemble_optimizer import EnsembleAdamW
from models.ensemble_transformer import (
    EnsembleTransformer,
    clip_member_gradients,
    member_losses,
    member_views,
    standalone,
)
from models.interventions import HeadChange
from models.lit_module import next_token_loss
from models.optimizer import OptimizerSettings
from models.transformer import AttentionOnlyTransformer, TransformerShape
from records.ensemble_checkpoint import join_members, split_member

OPTIONS = [
    dict(normalization="none", positions="standard", biases=False),
    dict(normalization="layernorm", positions="standard", biases=True),
    dict(normalization="rmsnorm", positions="shortformer", biases=True),
]


def members(n: int, **options) -> list[AttentionOnlyTransformer]:
    shape = TransformerShape(n_layers=2, n_heads=2, d_model=12, d_head=4, n_ctx=9, d_vocab=7, **options)
    models = []
    for seed in range(n):
        torch.manual_seed(seed)
        model = AttentionOnlyTransformer(shape).double()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.startswith("W_"):
                    p.add_(0.1 * torch.randn_like(p))  # gains and biases away from 1 and 0: they must count
        models.append(model)
    return models


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_every_member_computes_what_the_single_model_computes(options):
    singles = members(3, **options)
    ensemble = EnsembleTransformer(singles)
    tokens = torch.randint(0, 7, (3, 5, 9), generator=torch.Generator().manual_seed(0))
    logits = ensemble(tokens)
    for k, single in enumerate(singles):
        torch.testing.assert_close(logits[k], single(tokens[k]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(member_losses(logits, tokens)[k], next_token_loss(single(tokens[k]), tokens[k]))


CHANGES = [  # member k's interventions, layer by layer: every forward-pass kind, and a member with none
    [(HeadChange(0, "clamp", target="induction", strength=0.7),), (HeadChange(1, "ablate", replacement="mean"),)],
    [(), ()],
    [(HeadChange(1, "temperature", factor=0.5), HeadChange(0, "ablate", keep="pattern", replacement="resample")), ()],
]


@pytest.mark.parametrize("options", OPTIONS[:2], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_each_members_interventions_change_it_as_they_change_the_single_model(options):
    singles = members(3, **options)
    ensemble = EnsembleTransformer(singles)
    ensemble.set_changes(CHANGES)
    tokens = torch.randint(0, 7, (3, 5, 9), generator=torch.Generator().manual_seed(1))
    member_losses(ensemble(tokens), tokens).sum().backward()
    for k, single in enumerate(singles):
        single.set_changes(dict(enumerate(CHANGES[k])))
        next_token_loss(single(tokens[k]), tokens[k]).backward()
        for name, p in ensemble.named_parameters():  # the values and the gradients the changes let through
            torch.testing.assert_close(p.grad[k], single.get_parameter(name).grad, rtol=1e-12, atol=1e-12)
    ensemble.set_changes([[(), ()]] * 3)
    assert all(layer.changes == [] for layer in ensemble.layers)  # none: the batched path again
    with pytest.raises(ValueError, match="changes for 2 members"):
        ensemble.set_changes(CHANGES[:2])


def test_members_are_views_with_the_single_models_names_and_order():
    singles = members(2, normalization="layernorm", biases=True)
    ensemble = EnsembleTransformer(singles)
    assert [n for n, _ in ensemble.named_parameters()] == [n for n, _ in singles[0].named_parameters()]
    views = member_views(ensemble)
    for k, view in enumerate(views):
        for name, p in view.state_dict().items():
            torch.testing.assert_close(p, singles[k].state_dict()[name], rtol=0, atol=0)
    with torch.no_grad():
        ensemble.W_U.add_(1.0)  # an in-place update (the optimizer's) is seen by the views at once
    torch.testing.assert_close(views[1].W_U, singles[1].W_U.detach() + 1.0)
    tokens = torch.randint(0, 7, (4, 9))
    torch.testing.assert_close(views[0].run_with_cache(tokens)[0], views[0](tokens))


def test_a_standalone_member_is_a_trainable_copy_that_draws_nothing_and_leaves_the_ensemble_alone():
    singles = members(2, normalization="layernorm", biases=True)
    ensemble = EnsembleTransformer(singles)
    view = member_views(ensemble)[1]
    view.set_changes({0: (HeadChange(0, "temperature", factor=2.0),)})
    before = torch.random.get_rng_state()
    copy = standalone(view)
    assert torch.equal(torch.random.get_rng_state(), before)  # no random initialisation drawn
    assert standalone(singles[0]) is singles[0]
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in copy.parameters())
    tokens = torch.randint(0, 7, (4, 9))
    torch.testing.assert_close(copy(tokens), view(tokens), rtol=0, atol=0)  # its weights and its interventions
    next_token_loss(copy(tokens), tokens).backward()
    with torch.no_grad():
        copy.W_U.add_(1.0)
    torch.testing.assert_close(ensemble.W_U[1], singles[1].W_U, rtol=0, atol=0)  # the ensemble is untouched


def test_a_member_of_a_different_shape_or_none_at_all_is_refused():
    with pytest.raises(ValueError, match="same shape"):
        EnsembleTransformer([*members(1), *members(1, normalization="layernorm")])
    with pytest.raises(ValueError, match="at least one member"):
        EnsembleTransformer([])


SETTINGS = [
    OptimizerSettings(lr=3e-3, weight_decay=0.0, betas=[0.9, 0.999], warmup_steps=0),
    OptimizerSettings(lr=1e-2, weight_decay=0.1, betas=[0.8, 0.95], warmup_steps=4),
    OptimizerSettings(lr=5e-4, weight_decay=0.01, betas=[0.9, 0.99], warmup_steps=2),
]


def torch_optimizer(model, s: OptimizerSettings):
    """The single run's optimizer and warmup (models.lit_module.InductionLM.configure_optimizers)."""
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay, betas=tuple(s.betas))
    ramp = (lambda step: min(1.0, (step + 1) / s.warmup_steps)) if s.warmup_steps > 0 else (lambda step: 1.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, ramp)


@pytest.mark.parametrize("settings", [SETTINGS, [SETTINGS[1]] * 3], ids=["each-its-own", "shared"])
def test_adamw_clipping_and_warmup_per_member_equal_torchs_on_separate_models(settings):
    singles = members(3, normalization="layernorm", biases=True)
    ensemble = EnsembleTransformer(members(3, normalization="layernorm", biases=True))
    optimizers = [torch_optimizer(m, s) for m, s in zip(singles, settings)]
    ensemble_optimizer = EnsembleAdamW(ensemble.parameters(), settings)
    clip = torch.tensor([0.5, 0.0, 2.0])  # 0: no clipping
    g = torch.Generator().manual_seed(1)
    for _ in range(7):
        tokens = torch.randint(0, 7, (3, 4, 9), generator=g)
        for k, (model, (opt, schedule)) in enumerate(zip(singles, optimizers)):
            opt.zero_grad()
            next_token_loss(model(tokens[k]), tokens[k]).backward()
            if clip[k] > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip[k]))
            opt.step()
            schedule.step()
        ensemble_optimizer.zero_grad()
        member_losses(ensemble(tokens), tokens).sum().backward()
        clip_member_gradients(list(ensemble.parameters()), clip)
        ensemble_optimizer.step()
    # b_K's gradient is zero up to round-off (softmax ignores a constant added to a query's scores), and
    # Adam scales that round-off up to steps of size lr: the bound is round-off's, not exactness's
    for k, model in enumerate(singles):
        for name, p in model.named_parameters():
            torch.testing.assert_close(ensemble.get_parameter(name)[k], p.detach(), rtol=1e-9, atol=1e-10)


def test_a_stopped_member_stays_as_it_is_while_the_others_train():
    ensemble = EnsembleTransformer(members(2))
    optimizer = EnsembleAdamW(ensemble.parameters(), [OptimizerSettings(warmup_steps=0)] * 2)
    before = {name: p.detach().clone() for name, p in ensemble.named_parameters()}
    optimizer.stop(1)
    tokens = torch.randint(0, 7, (2, 4, 9))
    member_losses(ensemble(tokens), tokens).sum().backward()
    optimizer.step()
    for name, p in ensemble.named_parameters():
        torch.testing.assert_close(p[1], before[name][1], rtol=0, atol=0)
        assert not torch.equal(p[0], before[name][0])


def test_a_members_checkpoint_split_out_and_joined_back_is_the_ensembles():
    ensemble = EnsembleTransformer(members(3))
    optimizer = EnsembleAdamW(ensemble.parameters(), [OptimizerSettings()] * 3)
    tokens = torch.randint(0, 7, (3, 4, 9))
    member_losses(ensemble(tokens), tokens).sum().backward()
    optimizer.step()
    checkpoint = {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": "2",
        "loops": {"fit_loop": {}},
        "state_dict": {f"model.{k}": v for k, v in ensemble.state_dict().items()},
        "optimizer_states": [optimizer.state_dict()],
    }
    parts = [
        split_member(checkpoint, k, {"config": {}, "ensemble": {"index": k}}, {"Tracker": {"k": k}}) for k in range(3)
    ]
    assert parts[2]["state_dict"]["model.W_E"].shape == ensemble.W_E.shape[1:]  # the single model's layout
    joined = join_members(parts, "EnsembleMembers")
    for name, tensor in checkpoint["state_dict"].items():
        torch.testing.assert_close(joined["state_dict"][name], tensor, rtol=0, atol=0)
    restored = EnsembleAdamW(ensemble.parameters(), [OptimizerSettings()] * 3)
    restored.load_state_dict(joined["optimizer_states"][0])
    for key, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(restored.state_dict()["state"][key][name], value, rtol=0, atol=0)
    assert joined["callbacks"]["EnsembleMembers"]["members"][2] == {"Tracker": {"k": 2}}
