"""The stage finder on trajectories whose truth is known, one command:

    python -m bench.stage_nulls                 # 100 draws of every case on both grids
    python -m bench.stage_nulls --draws 20 --resamples 200

Each case builds a synthetic trajectory on a grid of saved steps, runs
:mod:`metrics.dynamics.stages` on it with the defaults of ``conf/schema.py``'s ``StagesConfig``, and
judges the answer against the truth; the table gives how often it was right and the most common
answer. Two grids: the default run's 65 saved steps, and a log ∪ linear grid like Hoogland et al.
2024's (30 log-spaced steps in [1, 1500] and every 25th step). ``tests/metrics/test_stages.py``
asserts the same cases (≥ 95 % right over 100 draws); docs/results.md quotes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import Tensor

from conf.objects import stage_settings
from conf.schema import StagesConfig
from metrics.dynamics.stages import Boundary, StageSettings, dynamics_boundaries, llc_boundaries

DEFAULT_RUN_STEPS = torch.tensor(
    [0, 1, 2, 3, 5, 7, 10, 15, 22, 32, 47, 69, 100, 101, 149, 180, 190, 200, 210, 219, 220, 230, 240, 250, 260, 270]
    + [280, 290, 300, 310, 320, 322, 330, 340, 350, 360, 370, 380, 390, 400, 410, 420, 430, 440, 450, 460, 470, 473]
    + [480, 490, 500, 510, 520, 600, 695, 700, 800, 900, 1000, 1021, 1100, 1200, 1300, 1400, 1500],
    dtype=torch.float64,
)
"""The saved steps of the default run (``python train.py``): log-spaced, every 100, every 10 through the phase change."""
LOG_LINEAR_STEPS = torch.tensor(
    sorted(set(np.unique(np.round(np.geomspace(1, 1500, 30)).astype(int)).tolist()) | set(range(0, 1501, 25))),
    dtype=torch.float64,
)
"""Hoogland et al.'s kind of grid at this run's length: 30 log-spaced steps in [1, 1500] ∪ every 25th step."""
GRIDS = {"default run": DEFAULT_RUN_STEPS, "log ∪ linear": LOG_LINEAR_STEPS}

TOKENS, TOKEN_NOISE = 512, 0.02
"""Per-token losses: 512 tokens, each with Gaussian noise of 0.02 nats at every step."""
CHAINS, CHAIN_SPREAD = 4, 0.035
"""λ̂: 4 chains a step (the default), each off by N(0, (3.5 % of λ̂)²): the default run's chains agree to 0.3-10 %."""


def settings_of(config: StagesConfig, resamples: int | None = None) -> StageSettings:
    """The finder's settings from ``stages.*`` (the schema's defaults when ``config`` is ``StagesConfig()``),
    read as ``analysis.stages`` reads them; ``resamples`` overrides the bootstrap's size."""
    settings = stage_settings(OmegaConf.structured(config))
    return settings if resamples is None else dataclasses.replace(settings, resamples=resamples)


def sigmoid(steps: Tensor, centre: Tensor | float, width: Tensor | float) -> Tensor:
    return torch.sigmoid((steps - centre) / width)


def uniform(generator: torch.Generator, n: int, low: float, high: float) -> Tensor:
    return low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float64)


def token_losses(steps: Tensor, generator: torch.Generator, centres: tuple[float, ...]) -> Tensor:
    """``[steps, TOKENS]`` per-token losses: flat at a random level each without ``centres``; else
    every token falls once at each centre (its own centre ± 20 steps, width 25-30 steps, by 1-2.5
    nats when there are two, from 5.5 to 0.05-1 when there is one), plus noise."""
    t = steps[:, None]
    if not centres:
        clean = uniform(generator, TOKENS, 0.1, 5.5).expand(len(steps), TOKENS)
    else:
        clean = torch.full((len(steps), TOKENS), 5.5, dtype=torch.float64)
        for centre in centres:
            own = centre + uniform(generator, TOKENS, -20, 20)
            width = uniform(generator, TOKENS, 25, 30)
            drop = uniform(generator, TOKENS, 1, 2.5) if len(centres) > 1 else 5.5 - uniform(generator, TOKENS, 0.05, 1)
            clean = clean - drop * sigmoid(t, own, width)
    return clean + TOKEN_NOISE * torch.randn(clean.shape, generator=generator, dtype=torch.float64)


def token_excursion(steps: Tensor, generator: torch.Generator, up: float, down: float) -> Tensor:
    """``[steps, TOKENS]`` per-token losses, each flat at a random level in 3-5.5 nats, that rise by
    0.15-0.45 nats at ``up`` and come back at ``down`` (each token's own steps ± 20, width 25-30
    steps): one excursion, two transitions, plus noise."""
    t = steps[:, None]
    height = uniform(generator, TOKENS, 0.15, 0.45)
    edges = [edge + uniform(generator, TOKENS, -20, 20) for edge in (up, down)]
    widths = [uniform(generator, TOKENS, 25, 30) for _ in range(2)]
    clean = uniform(generator, TOKENS, 3, 5.5) + height * (
        sigmoid(t, edges[0], widths[0]) - sigmoid(t, edges[1], widths[1])
    )
    return clean + TOKEN_NOISE * torch.randn(clean.shape, generator=generator, dtype=torch.float64)


def llc_chains(curve: Tensor, generator: torch.Generator, spread: Tensor | None = None) -> Tensor:
    """``[steps, CHAINS]`` λ̂ of each chain around ``curve [steps]`` (sd ``spread``, default 3.5 % of λ̂)."""
    sd = CHAIN_SPREAD * curve.abs() if spread is None else spread
    return curve[:, None] + sd[:, None] * torch.randn(len(curve), CHAINS, generator=generator, dtype=torch.float64)


def plateau_curve(steps: Tensor) -> Tensor:
    """λ̂ flat at 1 to step 100, rising linearly in ln(step + 1) to 20 at step 300, flat to step 700,
    rising again to 35 at step 1500: boundaries at 100 (rise starts), 300 (rise ends) and 700 (rise starts)."""
    x = torch.log1p(steps)
    at = lambda step: math.log1p(step)
    first = 1 + 19 * ((x - at(100)) / (at(300) - at(100))).clamp(0, 1)
    return first + 15 * ((x - at(700)) / (at(1500) - at(700))).clamp(0, 1)


def peak_curve(steps: Tensor) -> Tensor:
    """λ̂ as the default run's (docs/results.md): flat at 1 to step 100, rising linearly in ln(step + 1)
    to 40 at step 450, falling to 31 at step 1500: boundaries at 100 (rise starts) and 450 (peak)."""
    x = torch.log1p(steps)
    at = lambda step: math.log1p(step)
    rise = 39 * ((x - at(100)) / (at(450) - at(100))).clamp(0, 1)
    return 1 + rise - 9 * ((x - at(450)) / (at(1500) - at(450))).clamp(0, 1)


def grid_distance(steps: Tensor, a: float, b: float) -> float:
    """How many grid steps apart ``a`` and ``b`` are (interpolated grid index)."""
    index = lambda s: float(np.interp(s, steps.numpy(), np.arange(len(steps))))
    return abs(index(a) - index(b))


def found_exactly(
    expected: list[tuple[str, float | tuple[float, float]]], tolerance: float = 2.0
) -> Callable[[list[Boundary], Tensor], bool]:
    """A judge: right when the boundaries are exactly ``expected`` ``(kind, where)`` in order, each
    of its kind (``"a | b"``: either) and within ``tolerance`` grid steps of ``where``, or inside it when ``where`` is a
    ``(low, high)`` range of steps."""

    def near(boundary: Boundary, where, steps: Tensor) -> bool:
        if isinstance(where, tuple):
            return where[0] <= boundary.step <= where[1]
        return grid_distance(steps, boundary.step, where) <= tolerance

    def judge(found: list[Boundary], steps: Tensor) -> bool:
        return len(found) == len(expected) and all(
            b.kind in kind.split(" | ") and near(b, where, steps) for b, (kind, where) in zip(found, expected)
        )

    return judge


@dataclass(frozen=True)
class Case:
    """One synthetic input: what it is, which signal reads it, its truth, and the judge of an answer."""

    name: str
    signal: str  # "llc" or "essential dynamics"
    truth: str
    build: Callable[[Tensor, torch.Generator], Tensor]  # (grid, generator) -> chains [n, c] or outputs [n, features]
    judge: Callable[[list[Boundary], Tensor], bool]


CASES = [
    Case(
        "λ̂ pure noise: 30 ± 1 (sd of each chain)",
        "llc",
        "no boundary",
        lambda steps, g: llc_chains(torch.full_like(steps, 30.0), g, torch.ones_like(steps)),
        found_exactly([]),
    ),
    Case(
        "per-token losses, pure noise",
        "essential dynamics",
        "no boundary",
        lambda steps, g: token_losses(steps, g, ()),
        found_exactly([]),
    ),
    Case(
        "per-token losses falling once, at 400",
        "essential dynamics",
        "one transition (one shift)",
        lambda steps, g: token_losses(steps, g, (400.0,)),
        found_exactly([("shift", 400.0)]),
    ),
    Case(
        "λ̂ rising once: 10 → 30, a sigmoid at 400 (width 25)",
        "llc",
        "one transition: its start in 285-400 (1 % to 50 % of the rise), its end in 400-515 (50 % to 99 %)",
        lambda steps, g: llc_chains(10 + 20 * sigmoid(steps, 400.0, 25.0), g),
        found_exactly(
            [("rise starts", (400 - 25 * math.log(99), 400.0)), ("rise ends", (400.0, 400 + 25 * math.log(99)))]
        ),
    ),
    Case(
        "per-token losses falling twice, at 350 and 1100",
        "essential dynamics",
        "two shifts, at 350 and 1100",
        lambda steps, g: token_losses(steps, g, (350.0, 1100.0)),
        found_exactly([("shift", 350.0), ("shift", 1100.0)]),
    ),
    Case(
        "per-token losses up by 0.15-0.45 at 350, back at 450",
        "essential dynamics",
        "two shifts, each inside its transition (the middle 80 % of a token's: ± 60 steps)",
        lambda steps, g: token_excursion(steps, g, 350.0, 450.0),
        found_exactly([("shift", (290.0, 410.0)), ("shift", (390.0, 510.0))]),
    ),
    Case(
        "per-token losses up by 0.15-0.45 at 800, back at 1000",
        "essential dynamics",
        "two shifts, each inside its transition (± 60 steps; the default run saves every 100 steps there)",
        lambda steps, g: token_excursion(steps, g, 800.0, 1000.0),
        found_exactly([("shift", (740.0, 860.0)), ("shift", (940.0, 1060.0))]),
    ),
    Case(
        "λ̂ rises, holds a plateau (300-700), rises again",
        "llc",
        "the plateau's edges, 300 and 700 (and the first rise's start, 100)",
        lambda steps, g: llc_chains(plateau_curve(steps), g),
        found_exactly([("rise starts", 100.0), ("rise ends", 300.0), ("rise starts", 700.0)]),
    ),
    Case(
        "λ̂ rises, peaks at 450, falls by a fifth (the default run's shape)",
        "llc",
        "the rise's start (100) and the peak (450): a peak, or the rise's end where the fall is within the noise",
        lambda steps, g: llc_chains(peak_curve(steps), g),
        found_exactly([("rise starts", 100.0), ("peak | rise ends", 450.0)]),
    ),
]


def find(case: Case, steps: Tensor, generator: torch.Generator, settings: StageSettings) -> list[Boundary]:
    """The finder's boundaries on one draw of ``case`` on the grid ``steps`` (those it keeps)."""
    data = case.build(steps, generator)
    if case.signal == "llc":
        found = llc_boundaries(steps, data, settings)[0]
    else:
        found = dynamics_boundaries(steps, data.float(), settings)[0]
    return [b for b in found if b.kept]


@dataclass(frozen=True)
class Tally:
    """How ``case`` fared over ``draws`` draws on one grid."""

    case: Case
    grid: str
    draws: int
    right: int
    answers: Counter
    seconds: float

    @property
    def rate(self) -> float:
        return self.right / self.draws


def tally(case: Case, grid: str, draws: int, settings: StageSettings) -> Tally:
    """Run ``case`` ``draws`` times (draw ``i`` seeded ``i``) on ``GRIDS[grid]``."""
    steps, right, answers = GRIDS[grid], 0, Counter()
    started = time.perf_counter()
    for draw in range(draws):
        found = find(case, steps, torch.Generator().manual_seed(draw), settings)
        right += case.judge(found, steps)
        answers[", ".join(f"{b.step:.0f} ({b.kind})" for b in found) or "none"] += 1
    return Tally(case, grid, draws, right, answers, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=100, help="random draws of each case on each grid (default 100)")
    parser.add_argument(
        "--resamples", type=int, default=0, help="bootstrap resamples a boundary (the answer does not depend on them)"
    )
    args = parser.parse_args(argv)
    settings = settings_of(StagesConfig(), args.resamples)
    print(
        f"stage_nulls: {args.draws} draws a case and grid; bandwidth {settings.bandwidth:g} (ln step), alpha {settings.alpha:g},"
        f" plateau {settings.plateau:g}, min_share {settings.min_share:g}"
    )
    print("| input | grid | truth | right | most common answer |\n| --- | --- | --- | --- | --- |")
    worst = 1.0
    for case in CASES:
        for grid in GRIDS:
            t = tally(case, grid, args.draws, settings)
            answer, times = t.answers.most_common(1)[0]
            print(f"| {case.name} | {grid} | {case.truth} | **{t.right}/{t.draws}** | {answer} ({times}) |")
            worst = min(worst, t.rate)
    print(
        f"stage_nulls: {'ok' if worst >= 0.95 else 'FAILED'}: every case right in at least 95 % of draws (worst {worst:.0%})"
    )
    return 0 if worst >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
