"""Developmental stages of a training run: essential dynamics and the turning points of curves.

Hoogland et al. 2024 ("The developmental landscape of in-context learning") cut training into
stages where the local learning coefficient's slope changes sign and where the *essential
dynamics* turn: the model's outputs on fixed inputs, taken over checkpoints, projected on their
first principal components (Olsson et al. 2022 did the same with per-token losses around the
phase change). Both signals are read here by one rule, :func:`turning_points`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.dynamics.phase_change import smooth


@dataclass(frozen=True)
class EssentialDynamics:
    """The trajectory of ``[steps, features]`` outputs in its first principal components.

    ``coords [steps, k]`` are the centred outputs projected on the components (PC1 first);
    ``explained [k]`` each component's share of the variance over the trajectory."""

    steps: Tensor
    coords: Tensor
    explained: Tensor


def essential_dynamics(steps: Tensor, outputs: Tensor, components: int = 3) -> EssentialDynamics:
    """PCA of ``outputs [steps, features]`` (one row per checkpoint, e.g. the per-token losses on
    fixed sequences) by a thin SVD of the centred rows; ``components`` is capped at ``steps - 1``."""
    if outputs.ndim != 2 or outputs.shape[0] < 3:
        raise ValueError(
            f"essential dynamics needs at least 3 checkpoints of [steps, features], got {tuple(outputs.shape)}"
        )
    centred = outputs.double() - outputs.double().mean(dim=0)
    u, s, _ = torch.linalg.svd(centred, full_matrices=False)
    k = min(components, outputs.shape[0] - 1)
    variance = s**2
    return EssentialDynamics(steps, (u[:, :k] * s[:k]).float(), (variance[:k] / variance.sum()).float())


@dataclass(frozen=True)
class TurningPoint:
    """A step where ``source`` (``llc``, ``PC1``, ...) stops rising and falls (``peak``) or the reverse (``trough``)."""

    step: float
    source: str
    kind: str


def turning_points(steps: Tensor, values: Tensor, window: int = 3, min_turn: float = 0.1) -> list[tuple[float, str]]:
    """The ``(step, "peak" | "trough")`` where the smoothed ``values [n]`` change slope sign and
    then move back by at least ``min_turn`` of their range (a zigzag filter: smaller wiggles,
    noise among them, are not turns). Endpoints are never turning points."""
    finite = torch.isfinite(values)
    steps, values = steps[finite].double(), values[finite].double()
    if len(values) < 3:
        return []
    curve = smooth(values, window)
    threshold = min_turn * float(curve.max() - curve.min())
    if threshold <= 0:
        return []
    found: list[tuple[float, str]] = []
    high = low = extreme = direction = 0  # direction: +1 rising, -1 falling, 0 before the first full swing
    for i in range(1, len(curve)):
        if direction == 0:
            high = i if curve[i] > curve[high] else high
            low = i if curve[i] < curve[low] else low
            if curve[high] - curve[low] >= threshold:
                direction, extreme = (1, high) if low < high else (-1, low)
        elif direction * float(curve[i] - curve[extreme]) > 0:
            extreme = i  # further along the current swing
        elif direction * float(curve[extreme] - curve[i]) >= threshold:  # moved back far enough: a turn
            found.append((float(steps[extreme]), "peak" if direction > 0 else "trough"))
            direction, extreme = -direction, i
    return found


def stage_boundaries(
    llc: tuple[Tensor, Tensor] | None,
    dynamics: EssentialDynamics | None,
    window: int = 3,
    min_turn: float = 0.1,
) -> list[TurningPoint]:
    """Every turning point of the LLC curve ``(steps, values)`` and of each essential-dynamics
    component, sorted by step."""
    points: list[TurningPoint] = []
    if llc is not None:
        points += [TurningPoint(step, "llc", kind) for step, kind in turning_points(*llc, window, min_turn)]
    if dynamics is not None:
        for c in range(dynamics.coords.shape[1]):
            found = turning_points(dynamics.steps, dynamics.coords[:, c], window, min_turn)
            points += [TurningPoint(step, f"PC{c + 1}", kind) for step, kind in found]
    return sorted(points, key=lambda p: (p.step, p.source))
