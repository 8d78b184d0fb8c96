"""``tracker.stop_after_phase_change`` (callbacks/phase_change_stop.py) on planted series: it stops 2 spans
after the later of the two phase changes, not at a loss's first step of two, and never without both."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from callbacks.phase_change_stop import StopAfterPhaseChange
from metrics.dynamics.phase_change import SMALLEST_PHASE_CHANGE


def logistic(steps, midpoint, width, high, low):
    return low + (high - low) / (1 + np.exp((steps - midpoint) / width))


def stop_step(loss, induction, every: int = 10) -> int | None:
    """Feed the callback one snapshot per ``every`` steps, as the tracker logs them; the step it stops at."""
    tracker = SimpleNamespace(latest=None)
    trainer = SimpleNamespace(should_stop=False)
    callback = StopAfterPhaseChange(tracker, SMALLEST_PHASE_CHANGE, window=5)
    for i, (l, s) in enumerate(zip(loss, induction)):
        tracker.latest = (i * every, {"loss/repeated": float(l), "heads/induction/top": float(s)})
        callback.on_train_batch_end(trainer, None, None, None, i)
        if trainer.should_stop:
            return i * every
    return None


STEPS = np.arange(0, 1200, 10, dtype=float)
NOISE = np.random.default_rng(0).normal(0, 0.03, len(STEPS))


def test_it_stops_two_spans_after_one_cliff():
    loss = logistic(STEPS, 400, 20, 5.5, 0.1) + NOISE
    induction = logistic(STEPS, 400, 20, 0.05, 0.9)
    stopped = stop_step(loss, induction)
    span = 2 * 20 * math.log(9)  # the logistic's 10-90 % span, ~88 steps
    assert stopped is not None and 400 + span / 2 + 2 * span - 30 <= stopped <= 400 + span / 2 + 2 * span + 40, stopped


def test_a_second_step_that_begins_within_two_spans_moves_the_stop_after_it():
    """The positional shortcut of short blocks (5.5 -> 2.5 at 200) then the induction circuit (2.5 -> 0.1
    at 380, the induction score rising with it), begun before the first step's stop: the stop moves past
    the second. A plateau longer than 2 spans between them would stop the run after the first
    (docs/emergence.md: experiment=emergence keeps blocks of 8-16 tokens, where the two are one cliff)."""
    loss = logistic(STEPS, 200, 20, 5.5, 2.5) + logistic(STEPS, 380, 25, 2.4, 0.0) + NOISE
    induction = logistic(STEPS, 200, 20, 0.05, 0.3) + logistic(STEPS, 380, 25, 0.0, 0.6)
    stopped = stop_step(loss, induction)
    assert stopped is not None and stopped > 380 + 25 * math.log(9) + 100, stopped


def test_without_a_phase_change_it_never_stops():
    flat = 5.5 + NOISE
    assert stop_step(flat, np.full(len(STEPS), 0.05)) is None
    cliff_without_induction = logistic(STEPS, 400, 20, 5.5, 0.1) + NOISE
    assert stop_step(cliff_without_induction, np.full(len(STEPS), 0.05)) is None
