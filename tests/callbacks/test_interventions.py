"""Interventions scheduled over training (callbacks/interventions.py): freezing holds weights
bit-identical through its window while the rest train, a graft copies the source step's weights,
a head chosen by score is recorded, and a run resumed inside a window equals the uninterrupted one."""

from __future__ import annotations

import json
import signal

import lightning as L
import pytest
import torch

from callbacks.interventions import Interventions
from data.probe import make_probe_batch
from models.interventions import Intervention
from models.lit_module import InductionLM
from models.optimizer import OptimizerSettings
from records.trajectory import Trajectory, TrajectoryWriter
from tests.helpers import SMALL, TINY, fit_repeated, quiet_trainer, run_train, run_train_until

SHAPE = SMALL
PROBE = make_probe_batch(0, 8, 8, 20)


class WeightRecorder(L.Callback):
    """Every parameter at every step (after the interventions callback has restored what it holds)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, torch.Tensor]] = {}

    def record(self, trainer, pl_module) -> None:
        self.steps[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

    def on_train_start(self, trainer, pl_module) -> None:
        self.record(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.record(trainer, pl_module)


def fit(plan: list[Intervention] | None, max_steps: int = 30, weight_decay: float = 0.1, run_dir=None):
    """Train the small model with ``plan`` (None: without the interventions callback at all); every
    step's weights, and the callback."""
    L.seed_everything(0, verbose=False)
    interventions, recorder = Interventions(plan or [], PROBE, run_dir), WeightRecorder()
    callbacks = [interventions, recorder] if plan is not None else [recorder]
    trainer = quiet_trainer(callbacks, max_steps, gradient_clip_val=1.0)
    fit_repeated(trainer, warmup_steps=5, weight_decay=weight_decay)
    return recorder.steps, interventions


def test_before_its_window_opens_training_is_bit_identical_to_training_without_interventions():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: bit-identical runs
    try:
        untouched, _ = fit(None, max_steps=12)
        waiting, _ = fit([Intervention("clamp", ("L0H0",), from_step=8)], max_steps=12)
    finally:
        torch.set_num_threads(threads)
    for step in range(9):  # the clamp acts from the update that makes step 9
        for name, weight in untouched[step].items():
            assert torch.equal(weight, waiting[step][name]), (step, name)
    assert not torch.equal(untouched[12]["layers.0.W_V"], waiting[12]["layers.0.W_V"])


@pytest.mark.parametrize("circuit, held, free", [("qk", ("W_Q", "W_K"), ("W_V", "W_O")), ("both", ("W_Q", "W_V"), ())])
def test_a_frozen_circuit_is_bit_identical_through_its_window_while_the_rest_trains(circuit, held, free):
    steps, _ = fit([Intervention("freeze", ("L0H1",), from_step=5, until_step=20, circuit=circuit)])
    for name in held:
        frozen = [steps[s][f"layers.0.{name}"][1] for s in range(5, 21)]
        assert all(torch.equal(frozen[0], w) for w in frozen), name  # weight decay 0.1 undone too
        assert not torch.equal(steps[4][f"layers.0.{name}"][1], frozen[0])  # it trained before the window
        assert not torch.equal(steps[25][f"layers.0.{name}"][1], frozen[0])  # and trains after it
        assert not torch.equal(steps[5][f"layers.0.{name}"][0], steps[20][f"layers.0.{name}"][0])  # the other head
    for name in free:
        assert not torch.equal(steps[5][f"layers.0.{name}"][1], steps[20][f"layers.0.{name}"][1])
    assert not torch.equal(steps[5]["layers.1.W_Q"], steps[20]["layers.1.W_Q"])


def test_a_graft_equals_the_source_step_and_stays_there_frozen(tmp_path):
    torch.manual_seed(7)
    source = InductionLM(SHAPE, OptimizerSettings(lr=1e-3, warmup_steps=0)).model
    writer = TrajectoryWriter(tmp_path / "source" / "trajectory", SHAPE, {"seed": 7})
    writer.add(40, source.state_dict(), ["a test step"])
    plan = [Intervention("graft", ("L0H1",), from_step=3, until_step=12, source=str(tmp_path / "source"), frozen=True)]
    steps, _ = fit(plan, max_steps=16)
    weights = Trajectory(tmp_path / "source").state_dict(40)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        key = f"layers.0.{name}"
        assert not torch.equal(steps[2][key][1], weights[key][1])
        for step in range(3, 13):
            assert torch.equal(steps[step][key][1], weights[key][1]), (name, step)
        assert not torch.equal(steps[3][key][0], weights[key][0])  # the other head is the run's own
        assert not torch.equal(steps[14][key][1], weights[key][1])  # free after until_step


def test_a_chosen_head_is_the_top_scorer_at_from_step_and_is_recorded(tmp_path):
    from callbacks.interventions import choose_head

    steps, interventions = fit([Intervention("ablate", ("top_prev_token",), from_step=10)], run_dir=tmp_path)
    record = json.loads((tmp_path / "intervention.json").read_text())
    (layer, head) = interventions.heads[0][0]
    assert record["interventions"][0]["heads"] == [f"L{layer}H{head}"]
    assert record["interventions"][0]["named"] == ["top_prev_token"]
    model = InductionLM(SHAPE, OptimizerSettings(lr=1e-3, warmup_steps=0)).model
    model.load_state_dict(steps[10])
    assert choose_head(model, PROBE, "prev_token") == (layer, head)


@pytest.mark.slow
def test_a_run_killed_inside_an_intervention_window_resumes_to_the_uninterrupted_run(tmp_path):
    window = [
        "intervention=clamp_prev_token",
        "intervention.heads=[top_prev_token]",
        "intervention.from_step=12",
        "intervention.until_step=45",
        "+intervention.also=[{kind: freeze, heads: [L1H0], circuit: ov, from_step: 20, until_step: 50}]",
        "trainer.num_threads=1",
        "trainer.checkpoint_every_n_steps=10",
        *TINY,
    ]
    straight = run_train(window, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    code, printed = run_train_until([f"hydra.run.dir={tmp_path / 'resumed'}", *window], 30, signal.SIGTERM)
    assert code != 0 and "step 30/" in printed, printed[-2000:]
    resumed = run_train([f"resume={tmp_path / 'resumed'}", *window], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    first, second = (Trajectory(tmp_path / name) for name in ("straight", "resumed"))
    assert first.steps == second.steps and 60 in first.steps
    for step in first.steps:
        for name, weight in first.state_dict(step).items():
            assert torch.equal(weight, second.state_dict(step)[name]), (step, name)
    records = [json.loads((tmp_path / name / "intervention.json").read_text()) for name in ("straight", "resumed")]
    assert records[0] == records[1]
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("straight", "resumed")]
    assert summaries[0]["intervention"] == summaries[1]["intervention"] == records[0]["description"]
    assert summaries[0]["final/loss/repeated"] == summaries[1]["final/loss/repeated"]
