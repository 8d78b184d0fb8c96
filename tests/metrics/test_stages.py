"""Stage boundaries on trajectories whose truth is known: noise gives none, one transition one,
two two, a plateau its edges (``bench.stage_nulls``' cases on the default run's grid and on a
log ∪ linear grid: the first 50 draws of each λ̂ case, 25 of each per-token-loss case; the benchmark
tallies 100 of every case), and the parts of the finder against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.stage_nulls import CASES, GRIDS, LOG_LINEAR_STEPS, llc_chains, plateau_curve, settings_of, tally
from conf.schema import StagesConfig
from metrics.dynamics.stages import (
    DYNAMICS_SOURCE,
    LLC_SOURCE,
    STILL,
    essential_dynamics,
    kernel_widths,
    llc_boundaries,
    local_linear_weights,
    mean_shifts,
    passage_excess,
    significant_components,
    stage_boundaries,
)

DEFAULTS = settings_of(StagesConfig(), resamples=0)


DRAWS = {"llc": 50, "essential dynamics": 25}
"""Draws of a case in the suite, by the signal it reads. A per-token-loss draw runs the finder's
permutation test (99 shuffled copies of a [65-87 × 512] matrix, ~0.15 s a draw on 2 cores) where a λ̂
draw takes ~0.02 s: 25 of each such case keep the ten of them at ~35 core-seconds, half their cost at 50.
The benchmark's 100 draws of every case are the measurement (docs/results.md, "The nulls")."""


@pytest.mark.slow
@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_the_finder_is_right_on_known_truths_in_95_percent_of_its_draws(case, grid):
    """The first :data:`DRAWS` of the 100 draws ``python -m bench.stage_nulls`` tallies for its table:
    at most two wrong of 50, one of 25."""
    result = tally(case, grid, draws=DRAWS[case.signal], settings=DEFAULTS)
    assert result.rate >= 0.95, (case.truth, result.answers.most_common(3))


def test_local_linear_fits_a_line_exactly_on_an_uneven_grid():
    """Value and slope of ``y = 3 + 2x`` at every point, whatever the kernel's widths."""
    x = torch.log1p(torch.tensor([0.0, 1, 2, 5, 10, 100, 101, 150, 400, 410, 1500], dtype=torch.float64))
    value, slope = local_linear_weights(x, kernel_widths(x, bandwidth=0.25))
    y = 3 + 2 * x
    torch.testing.assert_close(value @ y, y)
    torch.testing.assert_close(slope @ y, torch.full_like(x, 2.0))


def test_a_plateau_between_two_rises_is_found_with_its_interval_and_support():
    steps = LOG_LINEAR_STEPS
    settings = settings_of(StagesConfig(), resamples=100)
    found, states = llc_boundaries(steps, llc_chains(plateau_curve(steps), torch.Generator().manual_seed(0)), settings)
    assert [b.kind for b in found] == ["rise starts", "rise ends", "rise starts"]
    for boundary, truth in zip(found, (100, 300, 700), strict=True):
        assert boundary.source == LLC_SOURCE and boundary.support >= 0.9
        assert boundary.low <= boundary.step <= boundary.high and boundary.high - boundary.low < 100
        assert abs(boundary.step - truth) <= 2 * 25  # two grid steps
        assert boundary.statistic > states.q
    assert states.state[(steps > 350) & (steps < 650)].eq(STILL).all()  # no significant slope on the plateau


def test_chains_that_disagree_more_than_the_curve_moves_give_no_boundary():
    """The same rise, its chains 10 times as spread as the rise is tall: nothing is significant."""
    steps = LOG_LINEAR_STEPS
    curve = 10 + 2 * torch.sigmoid((steps - 400) / 25)
    chains = llc_chains(curve, torch.Generator().manual_seed(1), spread=torch.full_like(steps, 20.0))
    assert llc_boundaries(steps, chains, DEFAULTS)[0] == []


def test_a_diverged_step_is_left_out_and_one_chain_is_refused():
    steps = LOG_LINEAR_STEPS
    chains = llc_chains(plateau_curve(steps), torch.Generator().manual_seed(0))
    chains[10, 2] = math.nan
    assert [b.kind for b in llc_boundaries(steps, chains, DEFAULTS)[0]] == ["rise starts", "rise ends", "rise starts"]
    with pytest.raises(ValueError, match="at least 2 chains"):
        llc_boundaries(steps, chains[:, :1], DEFAULTS)


def test_parallel_analysis_keeps_planted_components_and_no_noise():
    generator = torch.Generator().manual_seed(0)
    t = torch.linspace(0, 1, 60, dtype=torch.float64)[:, None]
    noise = 0.05 * torch.randn(60, 300, generator=generator, dtype=torch.float64)
    assert significant_components(noise, alpha=0.01, seed=0) == 0
    loadings = torch.randn(2, 300, generator=generator, dtype=torch.float64)
    planted = torch.cat([torch.sigmoid((t - 0.3) / 0.03), torch.sigmoid((t - 0.7) / 0.03)], dim=1) @ loadings
    assert significant_components(planted + noise, alpha=0.01, seed=0) == 2


def test_mean_shifts_are_found_at_their_index_with_the_variance_they_carry():
    """Two dimensions, the mean jumping at index 20 and 45 of 60: the shares are what a hand
    computation of the between-segment sums of squares gives."""
    coords = torch.zeros(60, 2, dtype=torch.float64)
    coords[20:, 0] = 3.0
    coords[45:, 1] = 1.0
    coords += 0.01 * torch.randn(60, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    shifts = mean_shifts(coords.numpy(), min_share=0.05)
    assert [index for index, _ in shifts] == [20, 45]
    total = float((coords - coords.mean(0)).square().sum())
    # removing the shift at 20 merges [0, 20) with [20, 45): its first coordinate's jump of 3
    jump_20 = 20 * 25 / 45 * 3.0**2
    jump_45 = 25 * 15 / 40 * 1.0**2
    assert shifts[0][1] == pytest.approx(jump_20 / total, rel=0.02)
    assert shifts[1][1] == pytest.approx(jump_45 / total, rel=0.05)
    alone = 20 * 40 / 60 * (3.0**2 + (15 / 40) ** 2)  # the only shift: [0, 20) against [20, 60)
    assert mean_shifts(coords.numpy(), min_share=0.5) == [(20, pytest.approx(alone / total, rel=0.02))]


def test_the_prefix_sum_segment_cost_is_ruptures_l2_cost():
    """Every segment of a drifting 3-dimensional signal, and of a 1-dimensional one: the cost PELT
    reads (:class:`~metrics.dynamics.segment_cost.PrefixSumL2`) is ruptures' ``CostL2``, the segment's
    variance times its length, to rounding (of the signal's sum of squares)."""
    from ruptures.costs import CostL2

    from metrics.dynamics.segment_cost import PrefixSumL2

    rng = np.random.default_rng(0)
    drifting = rng.standard_normal((40, 3)) * [0.1, 1.0, 30.0] + np.linspace(0.0, 50.0, 40)[:, None]
    for signal in (drifting - drifting.mean(axis=0), rng.standard_normal(25)):
        ours, theirs = PrefixSumL2().fit(signal), CostL2().fit(signal)
        rounding = 1e-12 * float(np.square(signal).sum())
        for start in range(len(signal)):
            for end in range(start + 1, len(signal) + 1):
                assert ours.error(start, end) == pytest.approx(theirs.error(start, end), rel=1e-9, abs=rounding)


def test_passage_excess_is_the_line_against_the_segments_own_mean():
    """Before: 0 to step 9; after: 3 from step 12. Points at steps 10 and 11 on the straight line
    (1, 2) are a passage, better described by it than by their mean (excess −0.5); points level at
    1.5 are a stage of their own (+0.5)."""
    steps = np.arange(20, dtype=np.float64)
    on_line = np.concatenate([np.zeros(10), [1.0, 2.0], np.full(8, 3.0)])[:, None]
    level = np.concatenate([np.zeros(10), [1.5, 1.5], np.full(8, 3.0)])[:, None]
    assert passage_excess(on_line, steps, 0, 10, 12, 20) == pytest.approx(-0.5)
    assert passage_excess(level, steps, 0, 10, 12, 20) == pytest.approx(0.5)


def test_a_ramp_over_many_steps_is_one_shift_at_its_middle_and_a_real_plateau_stays():
    """A mean moving 0 → 4 linearly over steps 30-49 of 80 (a transition the saved steps resolve),
    in two dimensions, is one shift, at the first step past half its way (40); a staircase with a
    level stretch between its two steps keeps both."""
    noise = 0.01 * torch.randn(80, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t = torch.arange(80, dtype=torch.float64)
    ramp = ((t - 29.5) / 20).clamp(0, 1)
    coords = (torch.stack([4 * ramp, 2 * ramp], dim=1) + noise).numpy()
    shifts = mean_shifts(coords, min_share=0.05, steps=t.numpy())
    assert [index for index, _ in shifts] == [40]
    stairs = (torch.stack([3.0 * (t >= 20) + 3.0 * (t >= 50), 0 * t], dim=1) + noise).numpy()
    assert [index for index, _ in mean_shifts(stairs, min_share=0.05, steps=t.numpy())] == [20, 50]


def test_essential_dynamics_and_llc_boundaries_merge_by_step():
    steps = LOG_LINEAR_STEPS
    generator = torch.Generator().manual_seed(3)
    outputs = (
        5.5 - 4 * torch.sigmoid((steps[:, None] - 1000) / 20) + 0.02 * torch.randn(len(steps), 200, generator=generator)
    )
    chains = llc_chains(plateau_curve(steps), generator)
    found, dynamics, states = stage_boundaries((steps, chains), (steps, outputs.float()), DEFAULTS)
    assert [b.source for b in found] == [LLC_SOURCE, LLC_SOURCE, LLC_SOURCE, DYNAMICS_SOURCE]
    assert found[-1].kind == "shift" and abs(found[-1].step - 1000) <= 25
    assert dynamics.significant == 1 and states is not None


def test_essential_dynamics_needs_three_checkpoints():
    with pytest.raises(ValueError, match="at least 3"):
        essential_dynamics(torch.arange(2.0), torch.zeros(2, 5))
