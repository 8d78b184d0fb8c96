"""Locate the phase change in a logged series (Olsson et al. 2022): onset, midpoint and end of its
largest transition."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PhaseChange:
    """Steps where the smoothed series has made ``10% / 50% / 90%`` of its largest transition."""

    onset_step: float
    midpoint_step: float
    end_step: float
    start_value: float  # smoothed level before the transition
    end_value: float  # smoothed level after it


SMOOTHING_WINDOW = 5
"""Points of the moving average a phase change is read from (``tracker.smoothing_window``)."""


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


def detect_phase_change(
    steps: Tensor,
    values: Tensor,
    falling: bool = True,
    window: int = SMOOTHING_WINDOW,
    fractions=(0.1, 0.5, 0.9),
    max_width_fraction: float = 0.25,
    flat_fraction: float = 0.02,
    min_change: float = 0.0,
) -> PhaseChange | None:
    """The largest transition of ``values [n]`` logged at ``steps [n]`` (NaNs dropped).

    The transition is the maximal run of consecutive smoothed steps in the given direction that
    moves furthest, trimmed of its ends where it moves slower than ``flat_fraction`` of its
    steepest rate; it goes from ``high`` to ``low`` (for a fall). Each fraction's step is where the smoothed series first
    crosses ``high - fraction * (high - low)``, interpolated linearly between logged steps.

    A phase change is abrupt: None when the transition (first to last fraction) spans more than
    ``max_width_fraction`` of the logged steps, as a slow trend does, when there are under three
    points, when there is no movement in that direction, or when the transition moves the smoothed
    series by less than ``min_change`` (in the series' units): a flat, noisy loss has a largest
    fall too, of a few hundredths of a nat, and it is not a phase change.
    """
    if not all(0 < f < 1 for f in fractions):
        raise ValueError(f"fractions must lie strictly between 0 and 1, got {fractions}")
    keep = ~torch.isnan(values)
    steps, values = steps[keep].double(), values[keep].double()
    if len(values) < 3:
        return None
    s = smooth(values if falling else -values, window)
    slope = s[1:] - s[:-1]  # slope[i] joins s[i] and s[i + 1]
    runs = falling_runs(slope)
    if not runs:
        return None
    start, stop = min(runs, key=lambda run: float(slope[run[0] : run[1]].sum()))  # the largest fall
    steep = torch.nonzero(slope[start:stop] < flat_fraction * slope[start:stop].min()).flatten() + start
    first, last = int(steep[0]), int(steep[-1]) + 1
    high, low = s[first], s[last]
    if float(high - low) < min_change:
        return None  # noise, not a cliff
    crossings = []
    for fraction in fractions:
        level = high - fraction * (high - low)
        i = first + int(torch.nonzero(s[first : last + 1] <= level)[0])  # > first, since s[first] = high > level
        weight = (s[i - 1] - level) / (s[i - 1] - s[i])
        crossings.append(float(steps[i - 1] + weight * (steps[i] - steps[i - 1])))
    if crossings[-1] - crossings[0] > max_width_fraction * float(steps[-1] - steps[0]):
        return None  # a trend, not a cliff
    sign = 1.0 if falling else -1.0
    return PhaseChange(*crossings, start_value=sign * float(high), end_value=sign * float(low))
