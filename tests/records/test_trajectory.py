"""The weight trajectory: its schedule, the phase-change trigger, the file format and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from callbacks.trajectory_recorder import PhaseTrigger
from metrics.dynamics.phase_change import detect_phase_change
from models.transformer import AttentionOnlyTransformer, TransformerShape
from records.trajectory import (
    DEFAULT_BUDGET_STEPS,
    Trajectory,
    TrajectoryError,
    TrajectoryPlan,
    TrajectoryWriter,
    sparse_steps,
)

SHAPE = TransformerShape(n_layers=2, n_heads=2, d_model=16, d_head=4, n_ctx=9, d_vocab=11, normalization="layernorm")


def test_sparse_steps_are_log_spaced_linear_first_and_last():
    steps = sparse_steps(1500, 20, 100)
    assert {0, 1, 1500} <= set(steps) and all(s in steps for s in range(0, 1501, 100))
    log = sorted(s for s, reasons in steps.items() if "log" in reasons)
    assert log[:4] == [0, 1, 2, 3] and log[-1] == 1500  # round(1500 ** (i / 19)): dense early, sparse late
    assert all(b / a < 1.6 for a, b in zip(log[8:], log[9:]))  # a constant ratio once the rounding no longer collides
    assert steps[1500] == ["final", "linear", "log"]
    assert sparse_steps(10, 0, 0) == {0: ["log"], 10: ["final"]}


def test_the_budget_thins_the_linear_grid_first_then_the_log_grid():
    full = TrajectoryPlan.fit(1000, 10, 50, 100, budget=10**9, adaptive=True)
    assert (full.log_steps, full.every_n_steps) == (10, 50)
    per_step = 100
    thinned = TrajectoryPlan.fit(
        1000, 10, 50, per_step, budget=2 * 20 * per_step, adaptive=True
    )  # half the budget: 20 steps
    assert thinned.log_steps == 10 and thinned.every_n_steps > 50 and len(thinned.steps) <= 20
    no_linear = TrajectoryPlan.fit(1000, 10, 50, per_step, budget=2 * 8 * per_step, adaptive=True)
    assert no_linear.every_n_steps == 0 and no_linear.log_steps < 10 and len(no_linear.steps) <= 8
    with pytest.raises(ValueError, match="holds fewer than the first and last step"):
        TrajectoryPlan.fit(1000, 10, 50, per_step, budget=per_step, adaptive=False)


def test_an_unset_budget_is_40_mb_or_holds_16_steps_of_a_larger_model():
    small = TrajectoryPlan.fit(1500, 20, 100, 200_000, budget=None, adaptive=True)  # the default run's size
    assert small.budget == 40 * 2**20 and small == TrajectoryPlan.fit(1500, 20, 100, 200_000, 40 * 2**20, True)
    paper = 109_610_000  # bytes a step of 12 layers x 12 heads, d_model 768 (the refused command of issue 31)
    large = TrajectoryPlan.fit(1500, 20, 100, paper, budget=None, adaptive=True)
    assert large.budget == DEFAULT_BUDGET_STEPS * paper
    assert 2 <= len(large.steps) <= DEFAULT_BUDGET_STEPS // 2 and {0, 1500} <= set(large.steps)  # half: phase change
    with pytest.raises(ValueError, match="holds fewer than the first and last step"):
        TrajectoryPlan.fit(1500, 20, 100, paper, budget=40 * 2**20, adaptive=True)  # a set budget is kept


def sigmoid_curve(start=5.5, end=0.05, midpoint=400, width=25, noise=0.02, steps=range(0, 1501, 10)):
    generator = torch.Generator().manual_seed(0)
    values = [end + (start - end) / (1 + math.exp((s - midpoint) / width)) for s in steps]
    jitter = (torch.rand(len(values), generator=generator, dtype=torch.float64) - 0.5) * 2 * noise
    return list(steps), [v + float(j) for v, j in zip(values, jitter)]


@pytest.mark.parametrize("falling", [True, False])
def test_the_trigger_spans_the_detected_phase_change_and_stays_calm_after(falling):
    steps, values = sigmoid_curve()
    if not falling:
        values = [1 - v / 5.5 for v in values]  # an induction score rising from ~0 to ~1
    trigger = PhaseTrigger(falling=falling, threshold=0.05, settle=0.05, window=3)
    dense = [s for s, v in zip(steps, values) if trigger.update(v)]
    change = detect_phase_change(torch.tensor(steps, dtype=torch.float64), torch.tensor(values), falling=falling)
    look_back = 5 * 10  # the recorder writes the last 5 tracker steps when the trigger fires
    assert dense[0] - look_back <= change.onset_step and dense[-1] >= change.end_step
    assert dense == list(range(dense[0], dense[-1] + 1, 10))  # one episode: the noise after it starts none
    assert dense[-1] < 700  # it ends once the curve has settled


def test_the_trigger_ignores_nan_and_round_trips_its_state():
    trigger = PhaseTrigger(falling=True, threshold=0.05, settle=0.05, window=3)
    for value in (5.5, 5.5, float("nan"), 5.0, 4.0):
        trigger.update(value)
    copy = PhaseTrigger(falling=True, threshold=0.05, settle=0.05, window=3)
    copy.load_state_dict(trigger.state_dict())
    assert copy == trigger and trigger.active


def test_written_steps_load_back_exactly_and_truncate(tmp_path):
    torch.manual_seed(0)
    models = {step: AttentionOnlyTransformer(SHAPE) for step in (0, 10, 20)}
    writer = TrajectoryWriter(tmp_path / "trajectory", SHAPE, {"seed": 0}, {"wandb_id": "abc"})
    for step, model in models.items():
        writer.add(step, model.state_dict(), ["linear"])
    writer.add(10, models[10].state_dict(), ["adaptive"])  # kept already: reasons merged, no second file
    trajectory = Trajectory(tmp_path)
    assert trajectory.steps == [0, 10, 20] and trajectory.entries[10]["reasons"] == ["adaptive", "linear"]
    assert trajectory.shape == SHAPE and trajectory.config == {"seed": 0} and trajectory.run["wandb_id"] == "abc"
    loaded = trajectory.model(10)
    for (name, a), b in zip(models[10].state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    TrajectoryWriter(tmp_path / "trajectory", SHAPE, {}).truncate_after(10)
    assert (
        Trajectory(tmp_path).steps == [0, 10] and not (tmp_path / "trajectory" / "step-00000020.safetensors").exists()
    )


def test_bad_trajectories_are_one_line_errors(tmp_path):
    with pytest.raises(TrajectoryError, match="has no trajectory/index.json"):
        Trajectory(tmp_path)
    writer = TrajectoryWriter(tmp_path / "trajectory", SHAPE, {})
    writer.add(0, AttentionOnlyTransformer(SHAPE).state_dict(), ["log"])
    writer.add(5, AttentionOnlyTransformer(SHAPE).state_dict(), ["log"])
    with pytest.raises(TrajectoryError, match="step 7 was not saved .*2 steps: 0, 5"):
        Trajectory(tmp_path).check(7)
    path = tmp_path / "trajectory" / "step-00000000.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(TrajectoryError, match="bytes where the index says"):
        Trajectory(tmp_path).model(0)
    foreign = tmp_path / "trajectory" / "step-00000005.safetensors"
    save_file({"weight": torch.zeros(3)}, str(foreign))
    index = json.loads((tmp_path / "trajectory" / "index.json").read_text())
    index["steps"]["5"]["bytes"] = foreign.stat().st_size
    (tmp_path / "trajectory" / "index.json").write_text(json.dumps(index))
    with pytest.raises(TrajectoryError, match="not this run's model"):
        Trajectory(tmp_path).check(5)
    foreign.write_bytes(b"x" * foreign.stat().st_size)  # same size, not safetensors
    with pytest.raises(TrajectoryError, match="not a safetensors file"):
        Trajectory(tmp_path).check(5)
    (tmp_path / "trajectory" / "index.json").write_text("{")
    with pytest.raises(TrajectoryError, match="is not a trajectory index"):
        Trajectory(tmp_path)


def test_the_steps_around_an_interventions_window_are_kept_and_never_thinned():
    from models.interventions import Intervention, event_steps

    plan = [Intervention("ablate", ("L0H0",), from_step=600), Intervention("clamp", ("L0H1",), until_step=95)]
    events = event_steps(plan, max_steps=1000, every=10)
    assert events == (85, 95, *range(105, 196, 10), *range(590, 701, 10))  # and 95 itself; from_step 0 is no edge
    per_step = 1000
    plan_steps = TrajectoryPlan.fit(
        1000, 10, 50, per_step, budget=(len(events) + 8) * per_step, adaptive=False, events=events
    )
    assert plan_steps.every_n_steps == 0 and set(events) <= set(plan_steps.steps)  # the grids thinned, not the events
    assert all("intervention" in plan_steps.steps[s] for s in events)
