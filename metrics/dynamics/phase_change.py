"""Locate the phase change in a logged series (Olsson et al. 2022): onset, midpoint and end of its
largest transition, read from the data up to the transition and a little after it (what comes later
does not move them), or why there is none."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PhaseChange:
    """Steps where the smoothed series has made ``10% / 50% / 90%`` of its largest transition. ``end_step``
    None: the transition had not finished by the last logged step, ``last_step`` (its end is beyond the run;
    onset and midpoint are then those of the transition so far)."""

    onset_step: float
    midpoint_step: float
    end_step: float | None
    start_value: float  # smoothed level before the transition
    end_value: float  # smoothed level after it (reached by the last step, where it had not finished)
    last_step: float = math.nan

    @property
    def finished(self) -> bool:
        return self.end_step is not None

    @property
    def span_end(self) -> float:
        """The end, or the last logged step where the transition had not finished: where its span stops."""
        return self.end_step if self.end_step is not None else self.last_step


@dataclass(frozen=True)
class NoPhaseChange:
    """Why a series has no phase change, in one sentence."""

    reason: str


SMOOTHING_WINDOW = 5
"""Points of the moving average a phase change is read from (``tracker.smoothing_window``)."""

SMALLEST_PHASE_CHANGE = {"loss/repeated": 0.5, "heads/induction/top": 0.1}
"""The least a series must move (nats; score in [0, 1]) for its largest transition to be reported as a
phase change: on a flat run the noise's largest fall is a few hundredths of a nat, a cliff several nats."""

MAX_WIDTH_FRACTION = 0.75
"""A transition is abrupt when its 10-90 % span is at most this fraction of the steps up to its end: a
slow trend from the start spans nearly all of them, a cliff after a plateau a small part."""


def smooth(values: Tensor, window: int) -> Tensor:
    """Moving average ``[n] -> [n]``, centred for odd ``window`` (half a point late for even ones);
    the window shrinks at the edges."""
    if window <= 1:
        return values.clone()
    kernel = torch.ones(1, 1, window, dtype=values.dtype, device=values.device)
    pad = window // 2
    sums = torch.nn.functional.conv1d(values[None, None], kernel, padding=pad)[0, 0][: len(values)]
    counts = torch.nn.functional.conv1d(torch.ones_like(values)[None, None], kernel, padding=pad)[0, 0][: len(values)]
    return sums / counts


def falling_runs(slope: Tensor) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of the maximal runs of negative ``slope``."""
    runs, start = [], None
    for i, falling in enumerate((slope < 0).tolist() + [False]):
        if falling and start is None:
            start = i
        elif not falling and start is not None:
            runs.append((start, i))
            start = None
    return runs


def detect_phase_change(steps: Tensor, values: Tensor, falling: bool = True, **options) -> PhaseChange | None:
    """:func:`find_phase_change`'s phase change (``options``: its own), or None where there is none."""
    found = find_phase_change(steps, values, falling, **options)
    return found if isinstance(found, PhaseChange) else None


def find_phase_change(
    steps: Tensor,
    values: Tensor,
    falling: bool = True,
    window: int = SMOOTHING_WINDOW,
    fractions=(0.1, 0.5, 0.9),
    max_width_fraction: float = MAX_WIDTH_FRACTION,
    flat_fraction: float = 0.02,
    min_change: float = 0.0,
    under_way_fraction: float = 0.2,
    max_before_fraction: float = 1 / 3,
) -> PhaseChange | NoPhaseChange:
    """The largest transition of ``values [n]`` logged at ``steps [n]`` (NaNs dropped), or why there is none.

    The transition is the maximal run of consecutive smoothed steps in the given direction that
    moves furthest, trimmed of its ends where it moves slower than ``flat_fraction`` of its
    steepest rate; it goes from ``high`` to ``low`` (for a fall). Each fraction's step is where the smoothed series first
    crosses ``high - fraction * (high - low)``, interpolated linearly between logged steps. It has
    finished when the series moves slower than that again before its last point. Where it has not, but has
    slowed below ``under_way_fraction`` of its steepest rate, onset and midpoint are those of the fall so
    far (``low`` the level reached) and the end is beyond the run (``end_step`` None); faster than that, the
    fall is under way and there is none yet. Every quantity is read from the transition and the smoothing
    window after it: logged steps later than that move none of them.

    A phase change is abrupt: none when the transition's first-to-last-fraction span is more than
    ``max_width_fraction`` of the steps up to its last fraction (a slow trend from the start), when in a
    window as long as that span just before it the series moved more than ``max_before_fraction`` as far
    (a steady decline, cut into pieces by noise, is no cliff), when there
    are under three points, when there is no movement in that direction, or when the transition moves the
    smoothed series by less than ``min_change`` (in the series' units): a flat, noisy loss has a largest
    fall too, of a few hundredths of a nat, and it is not a phase change.
    """
    if not all(0 < f < 1 for f in fractions):
        raise ValueError(f"fractions must lie strictly between 0 and 1, got {fractions}")
    keep = ~torch.isnan(values)
    steps, values = steps[keep].double(), values[keep].double()
    direction = "fall" if falling else "rise"
    if len(values) < 3:
        return NoPhaseChange(f"fewer than 3 logged points ({len(values)})")
    s = smooth(values if falling else -values, window)
    slope = s[1:] - s[:-1]  # slope[i] joins s[i] and s[i + 1]
    runs = falling_runs(slope)
    if not runs:
        return NoPhaseChange(f"the series never {'falls' if falling else 'rises'}")
    start, stop = min(runs, key=lambda run: float(slope[run[0] : run[1]].sum()))  # the largest fall
    steep = torch.nonzero(slope[start:stop] < flat_fraction * slope[start:stop].min()).flatten() + start
    first, last = int(steep[0]), int(steep[-1]) + 1
    high, low = s[first], s[last]
    if last == len(s) - 1 and float(slope[-1]) < under_way_fraction * float(slope[start:stop].min()):
        return NoPhaseChange(
            f"its largest {direction} was still under way at the last step, {float(steps[-1]):.0f}"
            f" (at least {under_way_fraction:.0%} as fast as at its steepest)"
        )
    if float(high - low) < min_change:
        return NoPhaseChange(
            f"its largest {direction}, {float(high - low):.3g}, is under {min_change:g}: noise, not a cliff"
        )
    crossings = []
    for fraction in fractions:
        level = high - fraction * (high - low)
        below = torch.nonzero(s[first : last + 1] <= level).flatten()
        if len(below) == 0:  # not reached by the last point (the fitted floor is below it)
            crossings.append(math.nan)
            continue
        i = first + int(below[0])  # > first, since s[first] = high > level
        weight = (s[i - 1] - level) / (s[i - 1] - s[i])
        crossings.append(float(steps[i - 1] + weight * (steps[i] - steps[i - 1])))
    if math.isnan(crossings[1]):
        return NoPhaseChange(
            f"its largest {direction} had not reached its midpoint by the last step, {float(steps[-1]):.0f}"
        )
    reached_end = not math.isnan(crossings[-1])
    finished = reached_end and last < len(s) - 1  # it slowed before the last point
    span_end = crossings[-1]
    if span_end - crossings[0] > max_width_fraction * span_end:
        return NoPhaseChange(
            f"its largest {direction} is gradual: from {fractions[0]:.0%} to {fractions[-1]:.0%} it spans steps "
            f"{crossings[0]:.0f}-{span_end:.0f}, more than {max_width_fraction:.0%} of the steps up to its end"
        )
    width = span_end - crossings[0]
    before = crossings[0] - width  # a window as long as the transition, just before it
    if before >= float(steps[0]):
        fell_before = float(level_at(steps, s, before) - level_at(steps, s, crossings[0]))
        if fell_before > max_before_fraction * 0.8 * float(high - low):
            return NoPhaseChange(
                f"its largest {direction} is no cliff: in the {width:.0f} steps before it the series moved"
                f" {fell_before / (0.8 * float(high - low)):.0%} as far as in its own {width:.0f}, more than"
                f" {max_before_fraction:.0%} (a steady decline)"
            )
    sign = 1.0 if falling else -1.0
    return PhaseChange(
        crossings[0],
        crossings[1],
        crossings[-1] if finished else None,
        start_value=sign * float(high),
        end_value=sign * float(low),
        last_step=float(steps[-1]),
    )


def level_at(steps: Tensor, s: Tensor, step: float) -> Tensor:
    """``s [n]`` (logged at ``steps [n]``) at ``step``, interpolated linearly."""
    i = int(torch.searchsorted(steps, torch.tensor(step, dtype=steps.dtype)).clamp(1, len(steps) - 1))
    weight = (step - steps[i - 1]) / (steps[i] - steps[i - 1])
    return s[i - 1] + weight * (s[i] - s[i - 1])
