"""Phase-change detection on series with a known transition."""

from __future__ import annotations

import math

import pytest
import torch

from metrics.dynamics.phase_change import NoPhaseChange, PhaseChange, detect_phase_change, find_phase_change, smooth

LOGIT_90 = math.log(9)  # a logistic crosses 10% / 90% at midpoint -/+ width * ln 9


def logistic_fall(steps, midpoint, width, high=5.0, low=0.1):
    return high - (high - low) * torch.sigmoid((steps - midpoint) / width)


def test_logistic_fall_found_where_it_is():
    steps = torch.arange(0, 1500, 10, dtype=torch.float64)
    change = detect_phase_change(steps, logistic_fall(steps, 400.0, 30.0), falling=True, window=1)
    assert change.midpoint_step == pytest.approx(400.0, abs=3)
    assert change.onset_step == pytest.approx(400.0 - 30 * LOGIT_90, abs=5)
    assert change.end_step == pytest.approx(400.0 + 30 * LOGIT_90, abs=5)
    # levels are read where the fall becomes steep (2 % of its peak rate): within 1 % of the plateaus
    assert change.start_value == pytest.approx(5.0, abs=0.05)
    assert change.end_value == pytest.approx(0.1, abs=0.05)


def test_rising_series_with_noise_and_an_earlier_smaller_step():
    generator = torch.Generator().manual_seed(0)
    steps = torch.arange(0, 2000, 10, dtype=torch.float64)
    values = 0.05 + 0.1 * torch.sigmoid((steps - 200) / 10) + 0.8 * torch.sigmoid((steps - 1100) / 40)
    values = values + 0.01 * torch.randn(len(steps), generator=generator, dtype=torch.float64)
    change = detect_phase_change(steps, values, falling=False, window=5)
    assert change.midpoint_step == pytest.approx(1100, abs=30)  # the larger transition wins
    assert change.onset_step < change.midpoint_step < change.end_step


def test_nans_are_dropped_before_detection():
    steps = torch.arange(0, 1500, 10, dtype=torch.float64)
    with_gaps = logistic_fall(steps, 400.0, 30.0)
    with_gaps[::7] = float("nan")
    change = detect_phase_change(steps, with_gaps, falling=True, window=1)
    assert change.midpoint_step == pytest.approx(400.0, abs=5)


def test_short_rising_and_slow_series_give_none():
    steps = torch.arange(0, 1500, 10, dtype=torch.float64)
    assert detect_phase_change(steps[:2], torch.tensor([2.0, 1.0], dtype=torch.float64)) is None
    assert detect_phase_change(steps, steps.clone(), falling=True) is None  # only rises
    slow = 5.0 - 2.5 * (1 - torch.exp(-steps / 500))  # a steady decline over the whole run
    assert detect_phase_change(steps, slow, falling=True, window=5) is None


def test_smoothing_keeps_length_and_constants():
    values = torch.full((7,), 3.0, dtype=torch.float64)
    torch.testing.assert_close(smooth(values, 5), values)
    assert len(smooth(torch.arange(10.0, dtype=torch.float64), 4)) == 10


def test_a_fall_smaller_than_min_change_is_noise_not_a_phase_change():
    generator = torch.Generator().manual_seed(0)
    steps = torch.arange(0, 1000, 10, dtype=torch.float64)
    flat = 6.9 + 0.005 * torch.randn(len(steps), generator=generator, dtype=torch.float64)
    noise = detect_phase_change(steps, flat, falling=True, window=5)
    assert noise is not None and noise.start_value - noise.end_value < 0.05  # the noise's largest fall
    assert detect_phase_change(steps, flat, falling=True, window=5, min_change=0.5) is None
    cliff = detect_phase_change(steps, logistic_fall(steps, 400.0, 30.0), falling=True, min_change=0.5)
    assert cliff.midpoint_step == pytest.approx(400.0, abs=3)


def test_what_comes_after_the_cliff_moves_nothing_and_a_cut_run_says_where_it_stands():
    """A noisy logistic fall cut after every snapshot: while it falls faster than a fifth of its steepest
    rate there is none yet (it says it is under way); once slower, its midpoint is the whole run's within one snapshot
    and its onset within two; its end is reported once the fall has slowed to 2 % of its steepest rate (before
    that it is beyond the run, never another step), then within one snapshot of the whole run's. A run that
    stops soon after its cliff keeps it (a criterion on the run's length missed it)."""
    generator = torch.Generator().manual_seed(1)
    steps = torch.arange(0, 1500, 10, dtype=torch.float64)
    values = logistic_fall(steps, 400.0, 25.0) + 0.05 * torch.randn(
        len(steps), generator=generator, dtype=torch.float64
    )
    whole = find_phase_change(steps, values, min_change=0.5)
    assert whole.finished and whole.midpoint_step == pytest.approx(400, abs=10)
    first_reported = None
    under_way = find_phase_change(steps[:44], values[:44], min_change=0.5)  # cut at step 430: mid-cliff
    assert isinstance(under_way, NoPhaseChange) and "under way" in under_way.reason
    for k in range(len(steps)):
        cut = find_phase_change(steps[: k + 1], values[: k + 1], min_change=0.5)
        if isinstance(cut, NoPhaseChange):
            assert first_reported is None, (steps[k], cut.reason)  # never none again once it is there
            continue
        first_reported = first_reported or float(steps[k])
        assert abs(cut.midpoint_step - whole.midpoint_step) <= 10 and abs(cut.onset_step - whole.onset_step) <= 20
        if cut.finished:
            assert abs(cut.end_step - whole.end_step) <= 10, steps[k]
        else:
            assert cut.last_step == steps[k] and cut.span_end == steps[k]
    assert whole.midpoint_step < first_reported <= whole.end_step + 5 * 25  # a little after the cliff
    short = find_phase_change(steps[:60], values[:60], min_change=0.5)  # a 590-step run: the cliff is kept
    assert isinstance(short, PhaseChange) and short.midpoint_step == pytest.approx(whole.midpoint_step, abs=10)


def test_no_phase_change_says_why():
    steps = torch.arange(0, 1500, 10, dtype=torch.float64)
    assert "fewer than 3" in find_phase_change(steps[:2], torch.tensor([2.0, 1.0], dtype=torch.float64)).reason
    assert "never falls" in find_phase_change(steps, steps.clone()).reason
    slow = 5.0 - 2.5 * (1 - torch.exp(-steps / 500))
    assert "gradual" in find_phase_change(steps, slow, window=5).reason
    flat = 6.9 + 0.005 * torch.randn(len(steps), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert "noise, not a cliff" in find_phase_change(steps, flat, window=5, min_change=0.5).reason
