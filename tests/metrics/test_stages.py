"""Turning points and essential dynamics on curves whose turns are known by construction."""

from __future__ import annotations

import math

import pytest
import torch

from metrics.dynamics.stages import essential_dynamics, stage_boundaries, turning_points


def test_turning_points_of_a_sine_are_its_extrema():
    steps = torch.arange(0, 200, dtype=torch.float64)
    values = torch.sin(steps * 2 * math.pi / 100)  # peaks at 25, 125; troughs at 75, 175
    found = turning_points(steps, values, window=1, min_turn=0.1)
    assert found == [(25.0, "peak"), (75.0, "trough"), (125.0, "peak"), (175.0, "trough")]


def test_wiggles_smaller_than_min_turn_are_not_turns():
    steps = torch.arange(40, dtype=torch.float64)
    rise = torch.cat([torch.linspace(0, 1, 20), torch.linspace(1, 0, 20)])  # one peak, steps 19-20
    wiggle = 0.03 * torch.tensor([(-1.0) ** i for i in range(40)])  # noise: 6 % of the range
    assert turning_points(steps, rise + wiggle, window=1, min_turn=0.1) == [(20.0, "peak")]  # 1.03 at 20
    assert turning_points(steps, torch.linspace(0, 1, 40), window=3) == []  # monotone: one stage
    assert turning_points(steps, torch.ones(40), window=3) == []  # flat: no range at all


def test_uneven_steps_are_reported_as_steps_not_indices():
    steps = torch.tensor([0.0, 1, 3, 10, 30, 100, 300, 1000])
    values = torch.tensor([0.0, 1, 2, 3, 2, 1, 0, -1])
    assert turning_points(steps, values, window=1) == [(10.0, "peak")]


def test_essential_dynamics_turns_where_the_outputs_change_direction():
    """Outputs move along direction a for 30 checkpoints, then along b: PC1 and PC2 are (a mix of)
    a and b; the trajectory turns at checkpoint 30, so some component has a turning point there."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=generator), torch.randn(50, generator=generator)
    t = torch.arange(60, dtype=torch.float64)
    outputs = torch.where(t[:, None] < 30, t[:, None] * a, 30 * a + (t[:, None] - 30) * 2 * b).float()
    dynamics = essential_dynamics(t * 10, outputs, components=3)
    assert dynamics.coords.shape == (60, 3) and dynamics.explained[:2].sum() > 0.99
    boundaries = stage_boundaries(None, dynamics, window=1, min_turn=0.1)
    assert any(p.step == pytest.approx(290, abs=10) and p.source in ("PC1", "PC2") for p in boundaries), boundaries


def test_llc_and_dynamics_boundaries_are_merged_by_step():
    steps = torch.arange(50, dtype=torch.float64)
    llc = torch.cat([torch.linspace(0, 10, 25), torch.linspace(10, 6, 25)])
    outputs = torch.stack([torch.cat([torch.linspace(0, 1, 10), torch.linspace(1, -1, 40)]), torch.zeros(50)], 1)
    points = stage_boundaries((steps, llc), essential_dynamics(steps, outputs.repeat(1, 3), 2), window=1)
    assert (24.0, "llc", "peak") in [(p.step, p.source, p.kind) for p in points]
    assert 9.0 in [p.step for p in points if p.source == "PC1"]
    assert [p.step for p in points] == sorted(p.step for p in points)


def test_essential_dynamics_needs_three_checkpoints():
    with pytest.raises(ValueError, match="at least 3"):
        essential_dynamics(torch.arange(2.0), torch.zeros(2, 5))
