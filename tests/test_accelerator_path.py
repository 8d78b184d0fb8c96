"""The CUDA and Apple-silicon path, proven on this CPU: every measured path (a snapshot, a tracker
step, an LLC estimate, training steps, a re-scoring) run under a simulated accelerator
(``tests/simulated_device.py``) that fails where the project creates a tensor without a device,
mixes the CPU and the model's device, or makes float64 on the model's device; the host syncs of a
training step that neither measures nor saves counted; half-precision weights measured as float32;
and ``trainer=gpu`` on a Mac."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from conf.schema import TrackerConfig
from data.probe import make_probe_batch
from metrics.composition.measures import WEIGHT_MEASURES
from metrics.snapshot import take_snapshot
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import NO_FIGURES, TINY, composed, require_extra, tracker_of
from tests.simulated_device import SimulatedAccelerator

SHAPE = TransformerShape(n_layers=2, n_heads=2, d_model=32, d_head=8, n_ctx=13, d_vocab=20)
ALL_MEASURES = tuple(WEIGHT_MEASURES)
GRAM_PATH = ("whitened", "whitened_resid", "token_space")
"""Frobenius measures on whitened bases only, at d_model < d_head²: scored through Gram matrices,
which first read each basis's condition number."""


def trained_model(seed: int = 0) -> AttentionOnlyTransformer:
    torch.manual_seed(seed)
    return AttentionOnlyTransformer(SHAPE)


def probe_batch():
    return make_probe_batch(0, 8, 6, SHAPE.d_vocab - 1, True)


def test_a_snapshot_makes_every_tensor_where_it_belongs_and_no_float64_on_the_device():
    model, probe = trained_model(), probe_batch()
    with SimulatedAccelerator() as accelerator:
        accelerator.keep_on_host(probe.tokens)
        every = dict(ablation=True, writes=True, matching=True)  # every part: ablation, writes, matching, validity
        take_snapshot(model, probe, composition={"measures": list(ALL_MEASURES), "baseline_samples": 50}, **every)
        take_snapshot(model, probe, composition={"measures": list(GRAM_PATH), "baseline_samples": 50})
        take_snapshot(
            model, probe, composition=False, validity=False, ablation={"method": "attribution"}
        )  # a backward pass
    assert not (
        accelerator.missing_device or accelerator.mixed or accelerator.float64_on_device or accelerator.not_on_mps
    )


def test_a_tracker_step_logs_and_stores_from_the_right_devices(tmp_path):
    from records.csv_log import ResumableCSVLogger

    settings = OmegaConf.structured(TrackerConfig)
    settings.measures, settings.baseline_samples = list(ALL_MEASURES), 50
    tracker = tracker_of(probe_batch(), settings, tmp_path)
    model = trained_model()
    tracker.open(model, 0)
    with SimulatedAccelerator() as accelerator:
        accelerator.keep_on_host(tracker.probe.tokens)
        tracker.snapshot([ResumableCSVLogger(tmp_path)], model, 0, last=True)
    tracker.close()
    assert (tmp_path / "tensors").is_dir()


def test_an_llc_estimate_reduces_devinterps_draws_on_the_cpu():
    require_extra("devinterp", "llc")
    from metrics.dynamics.llc import SGLDSettings, estimate_llc, head_masks

    model = trained_model()
    rows = torch.randint(0, SHAPE.d_vocab, (16, SHAPE.n_ctx), generator=torch.Generator().manual_seed(0))
    settings = SGLDSettings(lr=1e-3, n_beta=5.0, localization=100.0, chains=2, draws=6, burnin=2, batch_size=8)
    with SimulatedAccelerator():
        device_rows = rows.to(model.W_E.device)  # as callbacks/llc_estimates.py hands them over
        whole = estimate_llc(model, device_rows, settings)
        alone = estimate_llc(model, device_rows, settings, param_masks=head_masks(model, 1, 0))
    assert math.isfinite(whole.mean) and math.isfinite(alone.mean)


class StepSyncs(L.Callback):
    """The simulated accelerator's host syncs in each optimizer step: from one step's start to the next's."""

    def __init__(self, accelerator: SimulatedAccelerator) -> None:
        self.accelerator = accelerator
        self.by_step: dict[int, tuple[int, list[str]]] = {}
        self.started: tuple[int, int] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.close(trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self.close(trainer.global_step)

    def close(self, step: int) -> None:
        count = self.accelerator.syncs
        if self.started is not None:
            first, before = self.started
            self.by_step[first] = (count - before, self.accelerator.sync_sites[before:count])
        self.started = (step, count)


TRAINING = [
    *TINY,
    "trainer.max_steps=40",
    "trainer.log_every_n_steps=20",
    "trainer.checkpoint_every_n_steps=1000",
    "stages.llc.every_n_steps=20",
    "stages.llc.chains=2",
    "stages.llc.draws=6",
    "stages.llc.burnin=2",
    "stages.llc.batches=1",
    "logger=csv",
    NO_FIGURES,  # drawn from the CSV, on the CPU: nothing of the accelerator's
]


@pytest.fixture(scope="module")
def trained_on_the_accelerator(tmp_path_factory):
    """A tiny run trained under the simulated accelerator: tracker, trajectory, LLC estimates,
    checkpoints and the CSV log, as ``train.py`` builds them; the host syncs of each step."""
    require_extra("devinterp", "llc")
    from runtime.build import build_datamodule, build_module, build_trainer

    run_dir = tmp_path_factory.mktemp("accelerator")
    cfg = composed(*TRAINING)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    accelerator = SimulatedAccelerator()
    trainer = build_trainer(cfg, run_dir)
    counter = StepSyncs(accelerator)
    trainer.callbacks.insert(0, counter)
    module, data = build_module(cfg), build_datamodule(cfg)  # built on the CPU, as Lightning then moves them
    with accelerator:
        trainer.fit(module, datamodule=data)
    return run_dir, cfg, counter.by_step


def test_training_steps_make_every_tensor_where_it_belongs(trained_on_the_accelerator):
    run_dir, cfg, by_step = trained_on_the_accelerator
    assert sorted(by_step) == list(range(cfg.trainer.max_steps))


def test_a_training_step_that_neither_measures_nor_saves_syncs_with_the_host_at_most_once(trained_on_the_accelerator):
    from records.trajectory import Trajectory

    run_dir, cfg, by_step = trained_on_the_accelerator
    every = cfg.tracker.every_n_steps
    busy = set(Trajectory(run_dir).steps) | {cfg.trainer.max_steps}
    # a step's measuring and saving happen at its end: the window that starts at step s ends after step s + 1
    quiet = {
        s: found
        for s, found in by_step.items()
        if (s + 1) % every
        and (s + 1) % cfg.trainer.log_every_n_steps
        and (s + 1) % cfg.stages.llc.every_n_steps
        and s + 1 not in busy
        and s > 0
    }
    assert len(quiet) >= 10, sorted(quiet)
    worst = max(quiet.items(), key=lambda item: item[1][0])
    assert worst[1][0] <= 1, f"step {worst[0]}: {worst[1][0]} host syncs at {worst[1][1]}"


def test_interventions_during_training_keep_every_tensor_where_it_belongs(trained_on_the_accelerator, tmp_path):
    """Every kind at once (a clamp, an ablation keeping its pattern, a temperature, a chosen head's
    ablation, a frozen circuit, a graft from the run above) on the simulated accelerator: no tensor
    on the wrong side, and a step inside the windows that neither measures nor saves syncs at most once."""
    from records.trajectory import Trajectory
    from runtime.build import build_datamodule, build_module, build_trainer

    source, _, _ = trained_on_the_accelerator
    also = (
        "[{kind: ablate, heads: [L1H1], replacement: mean, keep: pattern, from_step: 3},"
        " {kind: temperature, heads: [L1H0], factor: 0.5},"
        " {kind: ablate, heads: [top_prev_token], replacement: resample, from_step: 12},"
        " {kind: freeze, heads: [L1H0], circuit: ov, from_step: 6, until_step: 18},"
        f" {{kind: graft, heads: [L0H1], source: '{source}', frozen: true, from_step: 2}}]"
    )
    cfg = composed(
        *TINY,
        "trainer.max_steps=24",
        "trainer.log_every_n_steps=20",
        "trainer.checkpoint_every_n_steps=1000",
        "logger=csv",
        "intervention=clamp_induction",
        "intervention.heads=[L1H0]",
        "intervention.strength=0.5",
        f"+intervention.also={also}",
        NO_FIGURES,
    )
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    accelerator = SimulatedAccelerator()
    trainer = build_trainer(cfg, tmp_path)
    counter = StepSyncs(accelerator)
    trainer.callbacks.insert(0, counter)
    module, data = build_module(cfg), build_datamodule(cfg)
    with accelerator:
        trainer.fit(module, datamodule=data)
    record = json.loads((tmp_path / "intervention.json").read_text())
    assert len(record["interventions"]) == 6 and all(i["heads"] for i in record["interventions"])
    saved = set(Trajectory(tmp_path).steps)  # a step's saving happens at its end, in the next step's window
    quiet = [
        found
        for s, found in counter.by_step.items()
        if 3 <= s < cfg.trainer.max_steps - 1 and (s + 1) % cfg.tracker.every_n_steps and s + 1 not in saved
    ]
    assert len(quiet) >= 5 and max(n for n, _ in quiet) <= 1, quiet


def test_a_rescore_runs_on_the_models_device(trained_on_the_accelerator, capsys):
    from analysis.protocol import main
    from analysis.rescore import Rescore

    run_dir, _, _ = trained_on_the_accelerator
    with SimulatedAccelerator():
        assert main(Rescore, [str(run_dir), "--device", "cpu", "--every", "3"]) == 0
    assert (run_dir / "analysis" / "every=3" / "analysis.json").is_file()


def test_half_precision_weights_are_measured_as_their_float32_copy():
    """A bf16 run's snapshot is the float32 snapshot of the same (bf16-rounded) weights, to float32
    rounding: nothing is computed in bf16."""
    model, probe = trained_model(), probe_batch()
    half = model.to(torch.bfloat16)
    as_float = AttentionOnlyTransformer(SHAPE)
    as_float.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    options = dict(
        composition={"measures": list(ALL_MEASURES), "baseline_samples": 50},
        ablation={"method": "exact"},
        writes=True,
        matching=True,
    )
    got, want = take_snapshot(half, probe, **options), take_snapshot(as_float, probe, **options)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    for measure in ALL_MEASURES:
        for kind in ("Q", "K", "V"):
            close(got["composition"].scores[measure][kind], want["composition"].scores[measure][kind])
    close(got["matching"], want["matching"])
    close(got["behaviour"].scores, want["behaviour"].scores)
    close(got["writes"].scores, want["writes"].scores)
    for effect, values in got["ablation"].effects.effects().items():
        close(values, want["ablation"].effects.effects()[effect])
    assert got["loss_views"].repeated == pytest.approx(want["loss_views"].repeated, rel=1e-6)
    assert next(half.parameters()).dtype == torch.bfloat16  # the model itself is left as it was


@pytest.mark.parametrize(
    "cuda, mps, accelerator, resolved",
    [
        (True, False, "gpu", "cuda"),
        (False, True, "gpu", "mps"),
        (False, True, "auto", "mps"),
        (False, False, "auto", "cpu"),
    ],
)
def test_trainer_gpu_takes_the_gpu_the_machine_has(monkeypatch, cuda, mps, accelerator, resolved):
    from conf.validate import accelerator_problem, resolved_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert resolved_accelerator(accelerator) == resolved and accelerator_problem(accelerator) is None


def test_on_a_mac_float64_is_refused_whichever_way_mps_was_chosen(monkeypatch):
    from conf.validate import config_problems

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    for accelerator in ("gpu", "auto", "mps"):
        problems = config_problems(composed(f"trainer.accelerator={accelerator}", "tracker.precision=float64"))
        assert any("tracker.precision=float64 is not available on MPS" in p for p in problems), (accelerator, problems)
    assert config_problems(composed("trainer=gpu")) == []


def test_an_ensembles_training_step_makes_every_tensor_where_it_belongs_and_syncs_once():
    """The stacked model's step (forward, per-member losses and clipping, the per-member AdamW with
    members' own rates, members' own interventions, one member stopped) and the members' reading of
    their losses and weights."""
    from models.ensemble_module import EnsembleLM
    from models.ensemble_transformer import member_views
    from models.interventions import HeadChange
    from models.optimizer import OptimizerSettings

    members = [trained_model(seed) for seed in range(3)]
    settings = [OptimizerSettings(lr=lr, warmup_steps=w) for lr, w in ((1e-3, 0), (3e-3, 5), (2e-3, 2))]
    module = EnsembleLM(members, settings, [1.0, 0.0, 0.5])
    tokens = torch.randint(0, SHAPE.d_vocab, (3, 4, SHAPE.n_ctx), generator=torch.Generator().manual_seed(0))
    accelerator = SimulatedAccelerator()
    with accelerator:
        optimizer = module.configure_optimizers()  # as Lightning makes it: on the model's device
        module.optimizers = lambda use_pl_optimizer=True: optimizer  # Lightning's accessor, outside a trainer
        accelerator.keep_on_host(tokens)
        for step in range(3):
            device_tokens = tokens.to(module.model.W_E.device)  # as Lightning hands a batch over
            loss = module.training_step(device_tokens, step)
            optimizer.zero_grad()
            loss.backward()
            module.configure_gradient_clipping(optimizer)
            optimizer.step()
            if step == 1:
                module.stop(2)
                clamp, ablate = HeadChange(0, "clamp", target="induction"), HeadChange(1, "ablate", replacement="mean")
                module.model.set_changes([[(clamp,), ()], [(), (ablate,)], [(), ()]])  # from step 2 on
            before = accelerator.syncs
            n = module.model.size
            largest = torch.stack([p.detach().reshape(n, -1).abs().amax(dim=1) for p in module.model.parameters()])
            torch.cat([module.losses, largest.amax(dim=0)]).tolist()  # callbacks/ensemble_members.py's one read
            assert accelerator.syncs - before == 1
        views = member_views(module.model)
        take_snapshot(views[0], probe_batch(), composition={"measures": ["frobenius"], "baseline_samples": 50})
    mistakes = accelerator.missing_device + accelerator.mixed + accelerator.float64_on_device + accelerator.not_on_mps
    assert not mistakes, mistakes
