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


def smooth(values: Tensor, window: int) -> Tensor:
    """Centered moving average ``[n] -> [n]``; the window shrinks at the edges."""
    if window <= 1:
        return values.clone()
    kernel = torch.ones(1, 1, window, dtype=values.dtype)
    pad = window // 2
    sums = torch.nn.functional.conv1d(values[None, None], kernel, padding=pad)[0, 0][: len(values)]
    counts = torch.nn.functional.conv1d(torch.ones_like(values)[None, None], kernel, padding=pad)[0, 0][: len(values)]
    return sums / counts


def detect_phase_change(
    steps: Tensor, values: Tensor, falling: bool = True, window: int = 5, fractions=(0.1, 0.5, 0.9)
) -> PhaseChange | None:
    """The largest transition of ``values [n]`` logged at ``steps [n]`` (NaNs dropped).

    The transition is centred on the steepest step of the smoothed series in the given direction.
    It runs from the series' extreme before the centre (``high`` for a fall) to its extreme after
    (``low``); each fraction's step is where the smoothed series first crosses
    ``high - fraction * (high - low)`` on the way, interpolated linearly between logged steps.
    None when there are under three points or no movement in that direction.
    """
    if not all(0 < f < 1 for f in fractions):
        raise ValueError(f"fractions must lie strictly between 0 and 1, got {fractions}")
    keep = ~torch.isnan(values)
    steps, values = steps[keep].double(), values[keep].double()
    if len(values) < 3:
        return None
    s = smooth(values if falling else -values, window)
    slope = s[1:] - s[:-1]
    centre = int(slope.argmin())  # steepest fall is between centre and centre + 1
    if slope[centre] >= 0:
        return None
    first = int(s[: centre + 1].argmax())
    last = centre + 1 + int(s[centre + 1 :].argmin())
    high, low = s[first], s[last]
    crossings = []
    for fraction in fractions:
        level = high - fraction * (high - low)
        i = first + int(torch.nonzero(s[first : last + 1] <= level)[0])  # > first, since s[first] = high > level
        weight = (s[i - 1] - level) / (s[i - 1] - s[i])
        crossings.append(float(steps[i - 1] + weight * (steps[i] - steps[i - 1])))
    sign = 1.0 if falling else -1.0
    return PhaseChange(*crossings, start_value=sign * float(high), end_value=sign * float(low))
