"""Developmental stages of a training run: boundaries that survive a null, each with its interval.

Hoogland et al. 2024 ("The developmental landscape of in-context learning") cut training into
stages at the critical points of the local learning coefficient λ̂ against log step (where
dλ̂/d log t changes sign, or λ̂ enters or leaves a plateau, |dλ̂/d log t| ≈ 0) and where the
*essential dynamics* change: the model's outputs on fixed inputs over checkpoints, in their
principal components (Olsson et al. 2022 did the same with per-token losses). Their code places
the language model's boundaries by hand (``timaeus-research/icl``, ``notebooks/language.ipynb``);
here each signal has a stated test, so that noise and the shape of a single transition are not
reported as stages:

- **The LLC** (:func:`llc_boundaries`): λ̂ against ``x = ln(step + 1)`` (Hoogland's ``d_dlogt``),
  smoothed by local linear regression with a Gaussian kernel; the slope's standard error comes
  from the chains' spread at every step (the variance of a mean of chains, pooled by the same
  kernel); the slope counts as rising or falling only where it clears a *simultaneous* band,
  ``|slope| > q · SE`` with ``q`` the ``1 − alpha`` quantile of the largest ``|slope / SE|``
  that noise alone gives anywhere on the curve (Chaudhuri & Marron 1999, "SiZer for exploration of
  structures in curves"; here ``q`` by simulation). Boundaries are where that state changes: a
  peak or trough between a significant rise and fall, and the edges of every stretch where the
  slope is not significant (a plateau, Hoogland's |dλ̂/d log t| ≈ 0).
- **The essential dynamics** (:func:`dynamics_boundaries`): only the principal components whose
  variance beats a null (Horn 1965's parallel analysis: each feature permuted over the steps
  independently) are read; the trajectory in them is cut into stretches of constant mean by
  PELT (Killick et al. 2012; the ``ruptures`` library) with a penalty that is the larger of the
  BIC penalty of a mean shift in noise of the trajectory's own level (estimated from its
  first differences) and a share ``min_share`` of the trajectory's total variance, so a boundary
  must both clear the noise and carry a stated part of the change. A single transition is one
  shift of the mean; the components after PC1 that it also produces (its derivatives) carry too
  little variance to add a second.

Every boundary is re-found on resamples of its own data (the chains at every step for the LLC,
the features for the essential dynamics): ``support`` is the share of resamples in which a
boundary of the same kind is found near it, and ``low``-``high`` is the 5-95 % range of where.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class EssentialDynamics:
    """The trajectory of ``[steps, features]`` outputs in its first principal components.

    ``coords [steps, k]`` are the centred outputs projected on the components (PC1 first);
    ``explained [k]`` each component's share of the variance over the trajectory; ``significant``
    how many of the first components beat the parallel-analysis null (:func:`significant_components`)."""

    steps: Tensor
    coords: Tensor
    explained: Tensor
    significant: int = 0


@dataclass(frozen=True)
class Boundary:
    """A stage boundary at ``step`` from ``source`` (``llc`` or ``essential dynamics``).

    ``kind``: for the LLC ``peak``, ``trough``, ``rise starts``, ``rise ends``, ``fall starts`` or
    ``fall ends`` (a plateau's edges); for the essential dynamics ``shift`` (the mean of the
    trajectory moves). ``low``-``high``: where it falls in 90 % of the resamples; ``support``: the
    share of resamples that find it; ``statistic``: what kept it (the LLC: the largest ``|slope| /
    SE`` on the significant side(s), against the band ``q`` in ``statistic_name``; the essential
    dynamics: the share of the trajectory's variance the shift accounts for)."""

    step: float
    source: str
    kind: str
    low: float
    high: float
    support: float
    statistic: float
    statistic_name: str

    def describe(self) -> str:
        """``440 (430-450, in 97 % of resamples): llc peak``."""
        where = f"{self.step:.0f}"
        if not math.isnan(self.support):  # resampled
            interval = "" if math.isnan(self.low) else f"{self.low:.0f}-{self.high:.0f}, "
            where += f" ({interval}in {100 * self.support:.0f} % of resamples)"
        return f"{where}: {self.source} {self.kind}"


@dataclass(frozen=True)
class StageSettings:
    """How boundaries are read (defaults live in ``conf/schema.py``'s ``StagesConfig``)."""

    bandwidth: float  # the LLC's smoothing kernel's width in ln(step + 1)
    alpha: float  # the false-boundary rate each signal allows under its null
    plateau: float  # the LLC is flat where its slope is confidently below this share of its largest significant slope
    min_share: float  # a shift of the essential dynamics must carry this share of its variance
    resamples: int  # bootstrap resamples for each boundary's support and interval
    seed: int = 0


LLC_SOURCE = "llc"
DYNAMICS_SOURCE = "essential dynamics"
NEIGHBOURS = 2
"""The LLC's kernel is widened where the grid is sparse so that it always spans this many other steps."""
MIN_STEPS = NEIGHBOURS + 2
"""The LLC's boundaries are read from at least this many steps with a finite λ̂ (none are reported below)."""
NULL_DRAWS = 2000
"""Simulated noise curves behind the LLC's simultaneous band (its 1 − alpha quantile)."""


# ---- the LLC: significant slope against log step ----


def log_steps(steps: Tensor) -> Tensor:
    """``x = ln(step + 1)``, Hoogland et al.'s axis (``d_dlogt``): step 0 stays finite."""
    return torch.log1p(steps.double())


def local_linear_weights(x: Tensor, bandwidth: float) -> tuple[Tensor, Tensor]:
    """``(value [n, n], slope [n, n])``: row ``i`` holds the weights that give, from ``y [n]``, the
    local linear fit's value and slope at ``x[i]`` (tricube kernel, as LOESS; Cleveland 1979). The
    kernel's half-width at ``x[i]`` is ``bandwidth``, widened where the grid is sparse to reach past
    the ``NEIGHBOURS``-th nearest other step, so that no fit rests on one point; the kernel is
    compact, so a dense stretch of the grid far away never leaks into a sparse one."""
    distance = x[None, :] - x[:, None]  # [i, j]: x_j - x_i
    k = min(NEIGHBOURS, len(x) - 1)
    width = torch.maximum(torch.full_like(x, bandwidth), 1.25 * distance.abs().sort(dim=1).values[:, k])
    kernel = (1 - (distance.abs() / width[:, None]).clamp(max=1) ** 3) ** 3
    s0, s1, s2 = ((kernel * distance**p).sum(1) for p in (0, 1, 2))
    det = s0 * s2 - s1**2  # weighted least squares of y on [1, x - x_i], solved in closed form
    value = kernel * (s2[:, None] - s1[:, None] * distance) / det[:, None]
    slope = kernel * (s0[:, None] * distance - s1[:, None]) / det[:, None]
    return value, slope


def simultaneous_band(
    weights: tuple[Tensor, Tensor], pooling: Tensor, variance: Tensor, chains: int, settings: StageSettings
) -> float:
    """``q``: the ``1 − alpha`` quantile of ``max_i |slope_i| / SE_i`` over curves of pure noise,
    ``chains`` independent Gaussian chains a step with the variance ``variance [n]`` of their mean,
    each curve's SE estimated from its own chains as :func:`slope_states` does (so the band also
    carries the uncertainty of a spread read from a few chains)."""
    generator = torch.Generator().manual_seed(settings.seed)
    shape = (len(variance), chains, NULL_DRAWS)
    noise = torch.randn(shape, generator=generator, dtype=torch.float64) * (variance * chains).sqrt()[:, None, None]
    slope_w = weights[1]
    se = (slope_w**2 @ (pooling @ (noise.var(dim=1) / chains))).sqrt()
    z = (slope_w @ noise.mean(dim=1)).abs() / se
    return float(torch.quantile(z.max(dim=0).values, 1 - settings.alpha))


RISING, FALLING, FLAT, UNDETERMINED = 1, -1, 0, 2


@dataclass(frozen=True)
class SlopeStates:
    """The LLC's smoothed curve and what its slope does at every step. ``state [n]``: ``RISING`` or
    ``FALLING`` where ``|z| > q`` (``z = slope / SE``); elsewhere ``FLAT`` (a plateau) where the
    slope is small, ``|slope| <= plateau`` (a share of the largest significant ``|slope|``), and
    ``UNDETERMINED`` where it is not small but not significant either (too few or too noisy chains
    to tell, e.g. at the ends of the curve). ``mean`` and ``variance`` are λ̂ and the variance of its mean at each step."""

    x: Tensor
    mean: Tensor
    variance: Tensor
    smoothed: Tensor
    slope: Tensor
    z: Tensor
    state: Tensor
    q: float


def slope_states(
    x: Tensor, chains: Tensor, weights: tuple[Tensor, Tensor], pooling: Tensor, q: float | None, settings: StageSettings
) -> SlopeStates:
    """:class:`SlopeStates` of ``chains [n, c]`` (each step's per-chain λ̂) at ``x [n]``; ``q`` is
    computed here when not given (resamples reuse the original curve's band)."""
    value_w, slope_w = weights
    mean = chains.mean(dim=1)
    variance = pooling @ (chains.var(dim=1) / chains.shape[1])  # of the mean at each step, kernel-pooled
    variance = variance.clamp(min=1e-24 * float(mean.abs().max()) ** 2 + 1e-300)
    if q is None:
        q = simultaneous_band(weights, pooling, variance, chains.shape[1], settings)
    slope = slope_w @ mean
    se = (slope_w**2 @ variance).sqrt()
    z = slope / se
    state = torch.full_like(slope, UNDETERMINED, dtype=torch.long)
    moving = z.abs() > q
    if moving.any():
        plateau = settings.plateau * float(slope[moving].abs().max())
        state[slope.abs() <= plateau] = FLAT
    state[z > q], state[z < -q] = RISING, FALLING
    return SlopeStates(x, mean, variance, value_w @ mean, slope, z, state, q)


def runs(state: Tensor) -> list[tuple[int, int, int]]:
    """``(value, start, stop)`` of each maximal run of equal values, ``[start, stop)``."""
    found, start = [], 0
    values = state.tolist()
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            found.append((values[start], start, i))
            start = i
    return found


def zero_crossing(x: Tensor, f: Tensor, i: int) -> float:
    """Where ``f`` crosses 0 between ``x[i]`` and ``x[i + 1]``, linearly interpolated."""
    a, b = float(f[i]), float(f[i + 1])
    t = a / (a - b) if a != b else 0.5
    return float(x[i] + min(max(t, 0.0), 1.0) * (x[i + 1] - x[i]))


def hinge(x: Tensor, y: Tensor, weight: Tensor) -> float:
    """The corner ``x0`` of the continuous two-piece linear fit ``y ≈ a + b (x - x0)⁻ + c (x - x0)⁺``
    (weighted least squares, ``x0`` searched on a fine grid between the first and last ``x``):
    where a plateau meets a slope, located on the raw curve rather than its smoothed blur."""
    best, where = math.inf, float(x[len(x) // 2])
    for x0 in torch.linspace(float(x[0]), float(x[-1]), 101, dtype=x.dtype)[1:-1]:
        design = torch.stack([torch.ones_like(x), (x - x0).clamp(max=0), (x - x0).clamp(min=0)], dim=1)
        root = weight.sqrt()[:, None]
        solution = torch.linalg.lstsq(design * root, y[:, None] * root).solution
        error = float(((design @ solution)[:, 0] - y).square().mul(weight).sum())
        if error < best:
            best, where = error, float(x0)
    return where


EDGE_KIND = {
    (RISING, "start"): "rise starts",
    (RISING, "end"): "rise ends",
    (FALLING, "start"): "fall starts",
    (FALLING, "end"): "fall ends",
}


def state_changes(s: SlopeStates) -> list[tuple[float, str, float]]:
    """``(x, kind, statistic)`` at every change between the determined runs of ``s.state``
    (undetermined stretches between them are skipped): a rise then a fall is a ``peak`` (where the
    smoothed slope crosses 0, nearest the middle of what lies between), a fall then a rise a
    ``trough``; a plateau then a rise ``rise starts`` and so on, located by :func:`hinge` on the means
    from the middle of one run to the middle of the next. Two runs of one kind, with undetermined
    steps between, are one stretch: no boundary. ``statistic``: the largest ``|z|`` of the moving run(s)
    the boundary borders."""
    pieces = [piece for piece in runs(s.state) if piece[0] != UNDETERMINED]
    found = []
    for (a, a0, a1), (b, b0, b1) in zip(pieces, pieces[1:]):
        if a == b:
            continue
        strongest = max(float(s.z[i0:i1].abs().max()) for v, i0, i1 in ((a, a0, a1), (b, b0, b1)) if v != FLAT)
        if FLAT not in (a, b):  # a rise meets a fall
            inside = range(a1 - 1, b0)
            turns = [i for i in inside if float(s.slope[i]) * float(s.slope[i + 1]) <= 0]
            middle = (a1 - 1 + b0) / 2
            i = min(turns, key=lambda t: abs(t - middle)) if turns else int(middle)
            found.append((zero_crossing(s.x, s.slope, i), "peak" if a == RISING else "trough", strongest))
            continue
        lo, hi = (a0 + a1 - 1) // 2, (b0 + b1) // 2 + 1  # middle of one run to the middle of the next
        window = slice(lo, hi)
        where = (
            hinge(s.x[window], s.mean[window], 1 / s.variance[window])
            if hi - lo >= 4
            else float(s.x[a1 - 1] + s.x[b0]) / 2
        )
        kind = EDGE_KIND[(b, "start")] if a == FLAT else EDGE_KIND[(a, "end")]
        found.append((where, kind, strongest))
    return found


def llc_boundaries(steps: Tensor, chains: Tensor, settings: StageSettings) -> tuple[list[Boundary], SlopeStates | None]:
    """Stage boundaries of the LLC curve: ``steps [n]``, ``chains [n, c]`` (λ̂ of each SGLD chain at
    each step; ``c >= 2``: the chains' spread is the noise), each with its resampled support and
    interval (:class:`Boundary`). Steps whose λ̂ is not finite (a diverged chain) are left out.
    Returns the boundaries and the curve's :class:`SlopeStates` (for figures); ``([], None)`` when
    fewer than ``MIN_STEPS`` steps are finite."""
    if chains.ndim != 2 or chains.shape[1] < 2:
        raise ValueError(f"the LLC's boundaries need at least 2 chains at every step, got {tuple(chains.shape)}")
    finite = torch.isfinite(chains).all(dim=1)
    steps, chains = steps[finite].double(), chains[finite].double()
    x = log_steps(steps)
    if len(x) < MIN_STEPS:  # e.g. every chain diverged: nothing to read
        return [], None
    weights = local_linear_weights(x, settings.bandwidth)
    pooling = weights[0].abs() / weights[0].abs().sum(dim=1, keepdim=True)
    states = slope_states(x, chains, weights, pooling, None, settings)
    found = state_changes(states)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    resampled = []
    for _ in range(settings.resamples):
        pick = torch.randint(0, chains.shape[1], chains.shape, generator=generator)
        resampled.append(state_changes(slope_states(x, chains.gather(1, pick), weights, pooling, states.q, settings)))
    window = torch.maximum(torch.full_like(x, settings.bandwidth), local_spacing(x))
    boundaries = []
    for where, kind, statistic in found:
        reach = 2 * float(window[int(torch.argmin((x - where).abs()))])
        matches = [
            min(
                (w for w, k, _ in again if k == kind and abs(w - where) <= reach),
                key=lambda w: abs(w - where),
                default=None,
            )
            for again in resampled
        ]
        boundaries.append(
            summarise(
                math.expm1(where),
                LLC_SOURCE,
                kind,
                [math.expm1(m) for m in matches if m is not None],
                len(resampled),
                statistic,
                f"max |slope|/SE (band q = {states.q:.2f})",
            )
        )
    return boundaries, states


def local_spacing(x: Tensor) -> Tensor:
    """``[n]``: the larger gap to a neighbouring grid point."""
    gaps = x.diff()
    return torch.maximum(torch.cat([gaps[:1], gaps]), torch.cat([gaps, gaps[-1:]]))


def summarise(step, source, kind, matched: list[float], total: int, statistic: float, name: str) -> Boundary:
    """A :class:`Boundary` from where its resamples found it again."""
    if matched:
        low, high = np.percentile(matched, [5, 95]).tolist()
    else:
        low = high = math.nan
    return Boundary(
        float(step),
        source,
        kind,
        float(low),
        float(high),
        len(matched) / total if total else math.nan,
        float(statistic),
        name,
    )


# ---- the essential dynamics: parallel analysis, then PELT ----


def principal_components(outputs: Tensor, components: int) -> tuple[Tensor, Tensor]:
    """``(coords [steps, k], explained [k])`` of the centred ``outputs [steps, features]``, from the
    eigendecomposition of their ``[steps, steps]`` Gram matrix (the thin SVD's ``U S``, cheaper when
    features outnumber steps)."""
    centred = outputs - outputs.mean(dim=0)
    values, vectors = torch.linalg.eigh(centred @ centred.T)
    values, vectors = values.flip(0).clamp(min=0), vectors.flip(1)
    k = min(components, outputs.shape[0] - 1)
    return vectors[:, :k] * values[:k].sqrt(), values[:k] / values.sum()


def significant_components(outputs: Tensor, alpha: float, seed: int) -> int:
    """How many of the leading principal components of ``outputs [steps, features]`` beat Horn's
    (1965) parallel analysis, as an exact permutation test: component ``k``'s variance must exceed
    the largest component's variance of every one of ``1/alpha - 1`` copies in which each feature is
    permuted over the steps on its own (each keeps its values; what moved them together is gone).
    Under the null of no common movement the observed largest component is one more such copy, so it
    beats them all with probability ``alpha``. Comparing every component with the copies' *largest*
    is stricter than Horn's rank-by-rank comparison."""
    centred = outputs - outputs.mean(dim=0)
    observed = torch.linalg.eigvalsh(centred @ centred.T).flip(0)
    generator = torch.Generator().manual_seed(seed)
    largest = 0.0
    for _ in range(max(1, round(1 / alpha) - 1)):
        shuffled = centred.gather(0, torch.rand(centred.shape, generator=generator).argsort(dim=0))
        largest = max(largest, float(torch.linalg.eigvalsh(shuffled @ shuffled.T)[-1]))
    beats = (observed[: outputs.shape[0] - 1] > largest).tolist()
    return beats.index(False) if False in beats else len(beats)


def noise_variance(coords: np.ndarray) -> float:
    """The per-dimension noise variance of a trajectory ``[steps, k]``, from its first differences
    (robust to the few large ones a transition makes: the median absolute deviation, 1.4826 · MAD
    of differences / sqrt 2), averaged over dimensions."""
    diffs = np.diff(coords, axis=0)
    mad = np.median(np.abs(diffs - np.median(diffs, axis=0)), axis=0)
    return float(np.mean((1.4826 * mad) ** 2 / 2))


def mean_shifts(coords: np.ndarray, min_share: float) -> list[tuple[int, float]]:
    """``(index, share)``: PELT's change points of the mean of ``coords [steps, k]`` (``ruptures``,
    L2 cost), the first index of each new segment, with the share of the trajectory's total
    variance that removing it would give back. Penalty: the larger of BIC's ``(k + 1) σ̂² ln n``
    (σ̂² from :func:`noise_variance`) and ``min_share`` of the total sum of squares."""
    import ruptures

    n, k = coords.shape
    total = float(((coords - coords.mean(axis=0)) ** 2).sum())
    if n < 4 or total <= 0:
        return []
    penalty = max((k + 1) * noise_variance(coords) * math.log(n), min_share * total)
    ends = ruptures.Pelt(model="l2", min_size=1, jump=1).fit(coords).predict(pen=penalty)[:-1]
    cuts = [0, *ends, n]

    def sse(a, b):
        part = coords[a:b]
        return float(((part - part.mean(axis=0)) ** 2).sum())

    return [
        (cuts[i], (sse(cuts[i - 1], cuts[i + 1]) - sse(cuts[i - 1], cuts[i]) - sse(cuts[i], cuts[i + 1])) / total)
        for i in range(1, len(cuts) - 1)
    ]


def essential_dynamics(
    steps: Tensor, outputs: Tensor, components: int = 3, alpha: float = 0.01, seed: int = 0
) -> EssentialDynamics:
    """PCA of ``outputs [steps, features]`` (one row per checkpoint, e.g. the per-token losses on
    fixed sequences): the first ``components`` (capped at ``steps - 1``), and how many of them are
    significant (:func:`significant_components`)."""
    if outputs.ndim != 2 or outputs.shape[0] < 3:
        raise ValueError(
            f"essential dynamics needs at least 3 checkpoints of [steps, features], got {tuple(outputs.shape)}"
        )
    outputs = outputs.double()
    coords, explained = principal_components(outputs, components)
    significant = min(significant_components(outputs, alpha, seed), coords.shape[1])
    return EssentialDynamics(steps, coords.float(), explained.float(), significant)


def dynamics_boundaries(
    steps: Tensor, outputs: Tensor, settings: StageSettings, components: int = 3
) -> tuple[list[Boundary], EssentialDynamics]:
    """Stage boundaries of the essential dynamics of ``outputs [steps, features]``: shifts of the
    trajectory's mean in its significant components (none when no component beats the null), each
    with its support and interval over resamples of the features. Returns them and the dynamics."""
    dynamics = essential_dynamics(steps, outputs, components, settings.alpha, settings.seed)
    k = dynamics.significant
    if k == 0:
        return [], dynamics
    outputs = outputs.double()
    found = mean_shifts(principal_components(outputs, k)[0].numpy(), settings.min_share)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    resampled = []
    for _ in range(settings.resamples):
        pick = torch.randint(0, outputs.shape[1], (outputs.shape[1],), generator=generator)
        resampled.append(
            [i for i, _ in mean_shifts(principal_components(outputs[:, pick], k)[0].numpy(), settings.min_share)]
        )
    grid = steps.double().tolist()
    boundaries = []
    for index, share in found:
        matches = [
            min((i for i in again if abs(i - index) <= 2), key=lambda i: abs(i - index), default=None)
            for again in resampled
        ]
        matched = [m for m in matches if m is not None]
        low, high = (
            (
                float(np.percentile([grid[m - 1] for m in matched], 5)),
                float(np.percentile([grid[m] for m in matched], 95)),
            )
            if matched
            else (math.nan, math.nan)
        )
        boundaries.append(
            Boundary(
                (grid[index - 1] + grid[index]) / 2,  # between the last step of one segment and the first of the next
                DYNAMICS_SOURCE,
                "shift",
                low,  # the saved steps on either side of the shift, in 90 % of the resamples
                high,
                len(matched) / len(resampled) if resampled else math.nan,
                share,
                "share of the trajectory's variance",
            )
        )
    return boundaries, dynamics


def stage_boundaries(
    llc: tuple[Tensor, Tensor] | None,
    outputs: tuple[Tensor, Tensor] | None,
    settings: StageSettings,
    components: int = 3,
) -> tuple[list[Boundary], EssentialDynamics | None, SlopeStates | None]:
    """Every boundary of the LLC curve ``(steps [n], chains [n, c])`` and of the essential dynamics
    of ``(steps [m], outputs [m, features])``, sorted by step; with the dynamics and the LLC's states."""
    boundaries: list[Boundary] = []
    dynamics = states = None
    if llc is not None:
        found, states = llc_boundaries(*llc, settings)
        boundaries += found
    if outputs is not None:
        found, dynamics = dynamics_boundaries(*outputs, settings, components)
        boundaries += found
    return sorted(boundaries, key=lambda b: (b.step, b.source)), dynamics, states
