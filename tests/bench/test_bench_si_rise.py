"""bench.si_rise's detector on curves whose answer is known: a step, noise, a rise that does not hold."""

from __future__ import annotations

import numpy as np

from bench.si_rise import LEVEL, PERSIST, false_rises, planted_errors, rise


def test_the_rise_is_the_first_step_of_a_run_of_snapshots_above_the_level():
    steps = np.arange(0, 200, 10)
    excess = np.where(steps >= 120, 0.3, 0.0)
    assert rise(steps, excess) == 120
    blip = excess.copy()
    blip[3 : 3 + PERSIST - 1] = 0.5  # above the level for one snapshot fewer than it must hold
    assert rise(steps, blip) == 120
    assert rise(steps, np.full(len(steps), LEVEL - 1e-9)) is None


def test_noise_under_the_level_never_fires_and_planted_rises_are_found_where_they_cross():
    rng = np.random.default_rng(0)
    steps = np.arange(0, 4000, 10)
    plateau = rng.normal(0.01, 0.01, 20)
    excess = np.concatenate([plateau, np.full(len(steps) - 20, 0.4)])
    assert false_rises(excess, 200, rng) == 0.0
    errors = planted_errors(excess, steps, 50, rng)
    assert np.isfinite(errors).all() and np.median(errors) <= 20  # within two snapshots
    assert len(planted_errors(np.full(len(steps), 0.01), steps, 5, rng)) == 0  # ends under 1.5x the level: none
