"""bench.rise_nulls' cases, fewer draws: on a re-score's grid the rise reading recovers a known
50-step lead to within a few steps, and a measure with no shift reads a gap near the noise floor."""

from __future__ import annotations

import numpy as np

from bench.rise_nulls import case, rescore_grid


def test_a_known_lead_is_read_to_a_few_steps_and_no_shift_reads_only_the_noise_floor():
    rng = np.random.default_rng(0)
    grid = rescore_grid()
    led = case(rng, 50, grid, grid, -50)
    assert abs(led["median error"]) < 3 and led["within 10 steps"] >= 0.95
    assert led["gap median"] > 0.1  # a 50-step lead is far above the noise
    same = case(rng, 50, grid, grid, 0)
    assert abs(same["median error"]) < 3
    assert same["gap 95th"] < 0.05
