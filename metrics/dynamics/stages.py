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
  smoothed by local linear regression (tricube kernel, as LOESS); the slope's standard error comes
  from the chains' spread at every step (the variance of a mean of chains, pooled by the same
  kernel); the slope counts as rising or falling only where it clears a *simultaneous* band,
  ``|slope| > q · SE`` with ``q`` the ``1 − alpha`` quantile of the largest ``|slope / SE|``
  that noise alone gives anywhere on the curve (Chaudhuri & Marron 1999, "SiZer for exploration of
  structures in curves"; here ``q`` by simulation, the chains' own spread re-estimated in every
  simulated curve). Where the slope is not significant and small (under ``plateau`` of the largest
  significant slope) the curve is on a plateau, Hoogland's |dλ̂/d log t| ≈ 0. Boundaries are where
  that state changes: a peak or trough between a significant rise and fall, and a plateau's edges.
  Written here because no maintained Python library gives a local slope with its standard error
  from replicate spread and a simultaneous band (statsmodels' ``lowess`` smooths without either).
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
from dataclasses import dataclass, field, replace

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
    share of resamples that find it (NaN without resamples); ``statistic``: what kept it (the LLC:
    the largest ``|slope| / SE`` on the significant side(s), against the band ``q`` in
    ``statistic_name``; the essential dynamics: the share of the trajectory's variance the shift
    accounts for); ``kept``: whether its support reaches ``min_support`` (a boundary that fewer
    resamples find is fragile to the estimate's own noise, and is not reported as a stage)."""

    step: float
    source: str
    kind: str
    low: float
    high: float
    support: float
    statistic: float
    statistic_name: str
    kept: bool = True

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
    plateau: (
        float  # the LLC is flat where its slope is not significant and under this share of its largest significant one
    )
    min_share: float  # a shift of the essential dynamics must carry this share of its variance
    resamples: int  # bootstrap resamples for each boundary's support and interval
    min_support: float = 0.5  # a boundary is kept when at least this share of the resamples finds it
    seed: int = 0


LLC_SOURCE = "llc"
DYNAMICS_SOURCE = "essential dynamics"
NEIGHBOURS = 2
"""The LLC's kernel is widened where the grid is sparse so that it always spans this many other steps."""
MIN_STEPS = NEIGHBOURS + 2
"""The LLC's boundaries are read from at least this many steps with a finite λ̂ (none are reported below)."""
NULL_DRAWS = 2000
"""Simulated noise curves behind the LLC's simultaneous band (its 1 − alpha quantile)."""


BOUNDARIES_PER_SOURCE = 2
"""Boundaries per source (the LLC, the essential dynamics) given a number of their own in a sweep's
table, so that the table over seeds has their mean and spread."""


def boundary_columns(boundaries: list[dict]) -> dict[str, float | str]:
    """A run's boundaries (as dicts of :class:`Boundary`'s fields) as a sweep table's columns:
    ``stage_boundaries`` (each described, with its interval) and the first boundaries of the LLC and
    of the essential dynamics as numbers (``llc_boundary_1``, ``ed_boundary_1``, ..., NaN where
    fewer were found). A boundary written by an earlier version (turning points, no intervals) is
    described without one."""
    described = [
        Boundary(**p).describe() if "support" in p else f"{p['step']:.0f}: {p['source']} {p['kind']} (no interval)"
        for p in boundaries
    ]
    columns: dict[str, float | str] = {"stage_boundaries": "; ".join(described) or "none"}
    for source, name in ((LLC_SOURCE, "llc"), (DYNAMICS_SOURCE, "ed")):
        found = sorted(p["step"] for p in boundaries if p["source"] == source)
        for i in range(BOUNDARIES_PER_SOURCE):
            columns[f"{name}_boundary_{i + 1}"] = float(found[i]) if i < len(found) else math.nan
    return columns


# ---- the LLC: significant slope against log step ----


def log_steps(steps: Tensor) -> Tensor:
    """``x = ln(step + 1)``, Hoogland et al.'s axis (``d_dlogt``): step 0 stays finite."""
    return torch.log1p(steps.double())


def kernel_widths(x: Tensor, bandwidth: float) -> Tensor:
    """``[n]``: the kernel's half-width at each ``x``: ``bandwidth``, widened where the grid is sparse
    to reach past the ``NEIGHBOURS``-th nearest other step, so that no fit rests on one point."""
    k = min(NEIGHBOURS, len(x) - 1)
    nearest = (x[None, :] - x[:, None]).abs().sort(dim=1).values[:, k]
    return torch.maximum(torch.full_like(x, bandwidth), 1.25 * nearest)


def local_linear_weights(x: Tensor, width: Tensor) -> tuple[Tensor, Tensor]:
    """``(value [n, n], slope [n, n])``: row ``i`` holds the weights that give, from ``y [n]``, the
    local linear fit's value and slope at ``x[i]`` (tricube kernel of half-width ``width[i]``, as
    LOESS; Cleveland 1979). The kernel is compact, so a dense stretch of the grid far away never
    leaks into a sparse one."""
    distance = x[None, :] - x[:, None]  # [i, j]: x_j - x_i
    kernel = (1 - (distance.abs() / width[:, None]).clamp(max=1) ** 3) ** 3
    s0, s1, s2 = ((kernel * distance**p).sum(1) for p in (0, 1, 2))
    det = s0 * s2 - s1**2  # weighted least squares of y on [1, x - x_i], solved in closed form
    value = kernel * (s2[:, None] - s1[:, None] * distance) / det[:, None]
    slope = kernel * (s0[:, None] * distance - s1[:, None]) / det[:, None]
    return value, slope


@dataclass(frozen=True)
class Smoother:
    """The LLC curve's smoothing on its grid ``x [n]`` (ln(step + 1)): each point's kernel
    half-width, the local linear value and slope weights ``[n, n]``, and ``pooling [n, n]``, the
    kernel's weights normalised (a step's variance is pooled with its neighbours')."""

    x: Tensor
    width: Tensor
    value: Tensor
    slope: Tensor
    pooling: Tensor

    @classmethod
    def on(cls, x: Tensor, bandwidth: float) -> Smoother:
        width = kernel_widths(x, bandwidth)
        value, slope = local_linear_weights(x, width)
        return cls(x, width, value, slope, value.abs() / value.abs().sum(dim=1, keepdim=True))


def simultaneous_band(smoother: Smoother, variance: Tensor, chains: int, settings: StageSettings) -> float:
    """``q``: the ``1 − alpha`` quantile of ``max_i |slope_i| / SE_i`` over curves of pure noise,
    ``chains`` independent Gaussian chains a step with the variance ``variance [n]`` of their mean,
    each curve's SE estimated from its own chains as :func:`slope_states` does (so the band also
    carries the uncertainty of a spread read from a few chains)."""
    generator = torch.Generator().manual_seed(settings.seed)
    shape = (len(variance), chains, NULL_DRAWS)
    noise = torch.randn(shape, generator=generator, dtype=torch.float64) * (variance * chains).sqrt()[:, None, None]
    mean = noise.mean(dim=1, keepdim=True)
    # each curve's variance over its chains, two-pass: torch's var over this middle axis took 10x as long
    chain_variance = (noise - mean).square().sum(dim=1) / (chains - 1)
    se = (smoother.slope**2 @ (smoother.pooling @ (chain_variance / chains))).sqrt()
    z = (smoother.slope @ mean.squeeze(1)).abs() / se
    return float(torch.quantile(z.max(dim=0).values, 1 - settings.alpha))


RISING, FALLING, STILL = 1, -1, 0


@dataclass(frozen=True)
class SlopeStates:
    """The LLC's smoothed curve and what its slope does at every step: ``state [n]`` is ``RISING``
    or ``FALLING`` where ``|z| > q`` (``z = slope / SE``), else ``STILL`` (no significant slope).
    ``x``, ``width``: the grid and the kernel's half-width there; ``mean`` and ``variance``: λ̂ and
    the variance of its mean at each step; ``plateau``: the slope under which a wide still stretch
    is a plateau (a share of the largest significant ``|slope|``)."""

    x: Tensor
    width: Tensor
    mean: Tensor
    variance: Tensor
    smoothed: Tensor
    slope: Tensor
    z: Tensor
    state: Tensor
    q: float
    plateau: float
    slope_weights: Tensor = field(repr=False)


def slope_states(smoother: Smoother, chains: Tensor, q: float | None, settings: StageSettings) -> SlopeStates:
    """:class:`SlopeStates` of ``chains [n, c]`` (each step's per-chain λ̂) on ``smoother``'s grid;
    ``q`` is computed here when not given (resamples reuse the original curve's band)."""
    mean = chains.mean(dim=1)
    variance = smoother.pooling @ (chains.var(dim=1) / chains.shape[1])  # of the mean at each step, pooled
    variance = variance.clamp(min=1e-24 * float(mean.abs().max()) ** 2 + 1e-300)
    if q is None:
        q = simultaneous_band(smoother, variance, chains.shape[1], settings)
    slope = smoother.slope @ mean
    z = slope / (smoother.slope**2 @ variance).sqrt()
    state = torch.where(z > q, RISING, torch.where(z < -q, FALLING, STILL))
    moving = state != STILL
    plateau = settings.plateau * float(slope[moving].abs().max()) if moving.any() else 0.0
    return SlopeStates(
        smoother.x, smoother.width, mean, variance, smoother.value @ mean, slope, z, state, q, plateau, smoother.slope
    )


def runs(state: Tensor) -> list[tuple[int, int, int]]:
    """``(value, start, stop)`` of each maximal run of equal values, ``[start, stop)``."""
    found, start = [], 0
    values = state.tolist()
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            found.append((values[start], start, i))
            start = i
    return found


def hinge(x: Tensor, y: Tensor, weight: Tensor) -> float:
    """The corner ``x0`` of the continuous two-piece linear fit ``y ≈ a + b (x - x0)⁻ + c (x - x0)⁺``
    (weighted least squares, ``x0`` searched on 99 points between the first and last ``x``): where a
    plateau meets a slope, located on the raw curve rather than its smoothed blur."""
    corners = torch.linspace(float(x[0]), float(x[-1]), 101, dtype=x.dtype)[1:-1, None]  # [99, 1]
    offset = x[None, :] - corners  # [99, n]
    design = torch.stack([torch.ones_like(offset), offset.clamp(max=0), offset.clamp(min=0)], dim=2)  # [99, n, 3]
    root = weight.sqrt()[None, :, None]
    solution = torch.linalg.lstsq(design * root, (y[None, :, None] * root).expand(len(corners), -1, -1)).solution
    error = ((design @ solution)[..., 0] - y).square().mul(weight).sum(dim=1)
    return float(corners[int(error.argmin()), 0])


KINDS = {
    (RISING, "start"): "rise starts",
    (RISING, "end"): "rise ends",
    (FALLING, "start"): "fall starts",
    (FALLING, "end"): "fall ends",
    (RISING, FALLING): "peak",
    (FALLING, RISING): "trough",
}


EVENTS = {kind: {kind} for kind in KINDS.values()} | {
    "peak": {"peak", "rise ends", "fall starts"},
    "trough": {"trough", "fall ends", "rise starts"},
}
"""What each kind of boundary says happened: a resample that finds a ``peak`` where the curve found
``rise ends`` (its fall now significant) finds the same boundary."""


def wide(s: SlopeStates, start: int, stop: int) -> bool:
    """Whether the steps ``[start, stop)`` span more than the kernel's full width at their middle,
    counted from the step before to the step after: wide enough to be told from a dip of the
    slope's noise or an extremum the smoothing has flattened."""
    left, right = s.x[max(start - 1, 0)], s.x[min(stop, len(s.x) - 1)]
    return float(right - left) > 2 * float(s.width[(start + stop - 1) // 2])


def slows(s: SlopeStates, run: tuple[int, int, int], stretch: tuple[int, int, int]) -> bool:
    """Whether the mean slope over the steps of ``stretch`` is smaller in the direction of ``run``
    than the mean slope over ``run`` by more than ``q`` standard errors of the difference (both are
    linear in the means, so the difference's variance is exact): the run has stopped, even where
    what follows is too noisy to call flat or a fall."""
    weights = s.slope_weights[run[1] : run[2]].mean(dim=0) - s.slope_weights[stretch[1] : stretch[2]].mean(dim=0)
    return run[0] * float(weights @ s.mean) > s.q * float((weights**2 @ s.variance).sqrt())


def state_changes(s: SlopeStates) -> list[tuple[float, str, float]]:
    """``(x, kind, statistic)`` where the significant slope changes. A still stretch (no significant
    slope) is a plateau when it is wider than the kernel (:func:`wide`) and its mean ``|slope|`` is
    under ``s.plateau``; then the runs around it end and start there (``rise ends``, ``fall starts``,
    ...: a plateau between two rises, a flat top between a rise and a fall). A rise and a fall that
    meet, directly or across a still stretch that is no plateau, make one ``peak`` (a fall and a
    rise a ``trough``). A wide still stretch at either end of the curve is where the first run starts
    or the last ends when it is a plateau or the run's slope is significantly larger than its
    (:func:`slows`). Any other still stretch is where the chains could not tell: no boundary. Each
    boundary is located by :func:`hinge` on the means from the middle of one run to the middle of the
    next; ``statistic`` is the largest ``|z|`` of the significant run(s) it borders."""
    pieces = runs(s.state)
    strongest = lambda piece: float(s.z[piece[1] : piece[2]].abs().max())
    found = []

    def locate(first, second) -> float:  # middle of one run to the middle of the next
        lo, hi = (first[1] + first[2] - 1) // 2, (second[1] + second[2]) // 2 + 1
        if hi - lo < 4:
            return float(s.x[first[2] - 1] + s.x[second[1]]) / 2
        window = slice(lo, hi)
        return hinge(s.x[window], s.mean[window], 1 / s.variance[window])

    flat = lambda piece: wide(s, piece[1], piece[2]) and float(s.slope[piece[1] : piece[2]].abs().mean()) <= s.plateau
    stops = lambda run, piece: flat(piece) or (wide(s, piece[1], piece[2]) and slows(s, run, piece))
    if len(pieces) > 1 and pieces[0][0] == STILL and stops(pieces[1], pieces[0]):  # still, then moving
        found.append((locate(pieces[0], pieces[1]), KINDS[(pieces[1][0], "start")], strongest(pieces[1])))
    for run, after, nxt in zip(pieces, pieces[1:], [*pieces[2:], None]):
        if run[0] == STILL:
            continue
        if after[0] != STILL:  # a rise meets a fall with no step between
            found.append((locate(run, after), KINDS[(run[0], after[0])], min(strongest(run), strongest(after))))
        elif nxt is not None and nxt[0] == -run[0] and not flat(after):  # across no plateau: an extremum
            found.append((locate(run, nxt), KINDS[(run[0], nxt[0])], min(strongest(run), strongest(nxt))))
        elif (nxt is None and stops(run, after)) or flat(after):  # the run ends; the next, if any, starts after
            found.append((locate(run, after), KINDS[(run[0], "end")], strongest(run)))
            if nxt is not None:
                found.append((locate(after, nxt), KINDS[(nxt[0], "start")], strongest(nxt)))
    return sorted(found)


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
    smoother = Smoother.on(x, settings.bandwidth)
    states = slope_states(smoother, chains, None, settings)
    found = state_changes(states)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    resampled = []
    for _ in range(settings.resamples):
        pick = torch.randint(0, chains.shape[1], chains.shape, generator=generator)
        resampled.append(state_changes(slope_states(smoother, chains.gather(1, pick), states.q, settings)))
    boundaries = []
    for where, kind, statistic in found:
        reach = float(smoother.width[int(torch.argmin((x - where).abs()))])  # a match lies within a kernel's reach
        matches = [
            min(
                (w for w, k, _ in again if EVENTS[k] & EVENTS[kind] and abs(w - where) <= reach),
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
    return judged(boundaries, settings.min_support), states


def summarise(step, source, kind, matched: list[float], total: int, statistic: float, name: str) -> Boundary:
    """A :class:`Boundary` from where its resamples found it again."""
    if matched:
        low, high = np.percentile(matched, [5, 95]).tolist()
    else:
        low = high = math.nan
    support = len(matched) / total if total else math.nan
    return Boundary(float(step), source, kind, float(low), float(high), support, float(statistic), name)


def judged(boundaries: list[Boundary], min_support: float) -> list[Boundary]:
    """``boundaries`` with ``kept`` set: their support reaches ``min_support``, or there were no resamples."""
    return [replace(b, kept=math.isnan(b.support) or b.support >= min_support) for b in boundaries]


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
    is stricter than Horn's rank-by-rank comparison. The copies are NumPy's ``Generator.permuted``
    (every column shuffled on its own in linear time: twice as fast as sorting random keys), each
    read by its ``[steps, steps]`` Gram matrix's eigenvalues (in torch, whose thread count the
    process sets). The copies stop as soon as one matches the observed largest component: the answer
    is then 0 whatever the rest would draw (the largest only grows), so it is the same, sooner."""
    centred = (outputs - outputs.mean(dim=0)).cpu().double()  # (steps, features): float64 off the device (MPS has none)
    observed = torch.linalg.eigvalsh(centred @ centred.T).flip(0)
    generator = np.random.default_rng(seed)
    largest = 0.0
    for _ in range(max(1, round(1 / alpha) - 1)):
        shuffled = torch.from_numpy(generator.permuted(centred.numpy(), axis=0))
        largest = max(largest, float(torch.linalg.eigvalsh(shuffled @ shuffled.T)[-1]))
        if largest >= observed[0]:
            return 0
    beats = (observed[: outputs.shape[0] - 1] > largest).tolist()
    return beats.index(False) if False in beats else len(beats)


def noise_variance(coords: np.ndarray) -> float:
    """The per-dimension noise variance of a trajectory ``[steps, k]``, from its first differences
    (robust to the few large ones a transition makes: the median absolute deviation, 1.4826 · MAD
    of differences / sqrt 2), averaged over dimensions."""
    diffs = np.diff(coords, axis=0)
    mad = np.median(np.abs(diffs - np.median(diffs, axis=0)), axis=0)
    return float(np.mean((1.4826 * mad) ** 2 / 2))


def mean_shifts(coords: np.ndarray, min_share: float, steps: np.ndarray | None = None) -> list[tuple[int, float]]:
    """``(index, share)``: the change points of the mean of ``coords [steps, k]``, the first index of
    each new segment, with the share of the trajectory's total variance that removing it would give
    back. PELT (``ruptures``, the L2 cost from prefix sums: :mod:`~metrics.dynamics.segment_cost`) with
    the penalty the larger of BIC's ``(k + 1) σ̂² ln n``
    (σ̂² from :func:`noise_variance`) and ``min_share`` of the total sum of squares; then every
    segment that is a passage rather than a stage is merged (:func:`passage_excess`), its two change
    points replaced by one where the passage is halfway (:func:`halfway`), so that one transition
    resolved by several saved steps is one shift however many steps it spans. ``steps [steps]`` (the saved steps; default: indices)
    time the passages."""
    import ruptures

    from metrics.dynamics.segment_cost import PrefixSumL2  # imports ruptures: only where shifts are found

    n, k = coords.shape
    total = float(((coords - coords.mean(axis=0)) ** 2).sum())
    if n < 4 or total <= 0:
        return []
    steps = np.arange(n, dtype=np.float64) if steps is None else np.asarray(steps, dtype=np.float64)
    penalty = max((k + 1) * noise_variance(coords) * math.log(n), min_share * total)
    ends = ruptures.Pelt(custom_cost=PrefixSumL2(), min_size=1, jump=1).fit(coords).predict(pen=penalty)[:-1]
    cuts = [0, *ends, n]

    def sse(a, b):
        part = coords[a:b]
        return float(((part - part.mean(axis=0)) ** 2).sum())

    while True:
        excess = [
            (passage_excess(coords, steps, cuts[j - 1], cuts[j], cuts[j + 1], cuts[j + 2]), j)
            for j in range(1, len(cuts) - 2)
        ]
        if not excess or min(excess)[0] >= penalty:
            break
        j = min(excess)[1]
        cuts[j : j + 2] = [halfway(coords, cuts[j - 1], cuts[j], cuts[j + 1], cuts[j + 2])]

    return [
        (cuts[i], (sse(cuts[i - 1], cuts[i + 1]) - sse(cuts[i - 1], cuts[i]) - sse(cuts[i], cuts[i + 1])) / total)
        for i in range(1, len(cuts) - 1)
    ]


def passage_excess(coords: np.ndarray, steps: np.ndarray, before: int, start: int, stop: int, after: int) -> float:
    """How much better the segment ``coords[start:stop]`` is described as a stage of its own (its
    mean) than as a passage: the straight line in time from the mean of ``coords[before:start]``,
    at that segment's last step, to the mean of ``coords[stop:after]``, at that one's first step.
    The difference of the two sums of squares; a segment whose excess is under what a change point
    must carry (the shifts' penalty) is a passage: a transition that the mean-shift model cut into
    steps. A stage between two transitions sits at its own level, off that line (Killick et al.
    2012's PELT has no notion of a gradual change; this is the check that adds one, written here
    because ``ruptures`` has none)."""
    first, last = coords[before:start].mean(axis=0), coords[stop:after].mean(axis=0)
    t0, t1 = steps[start - 1], steps[stop]
    along = ((steps[start:stop] - t0) / (t1 - t0))[:, None]
    segment = coords[start:stop]
    line = float(((segment - (first + along * (last - first))) ** 2).sum())
    own = float(((segment - segment.mean(axis=0)) ** 2).sum())
    return line - own


def halfway(coords: np.ndarray, before: int, start: int, stop: int, after: int) -> int:
    """Where the passage ``coords[start:stop]`` is halfway from the mean of ``coords[before:start]``
    to that of ``coords[stop:after]``: the first index whose projection on that gap reaches one
    half (``stop`` if none does), the first index of the new segment once the passage is one shift."""
    first, last = coords[before:start].mean(axis=0), coords[stop:after].mean(axis=0)
    gap = last - first
    if not gap.any():  # no direction to be halfway along
        return start
    along = (coords[start:stop] - first) @ gap / float(gap @ gap)
    past = np.flatnonzero(along >= 0.5)
    return start + int(past[0]) if len(past) else stop


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
    grid = steps.double().numpy()
    found = mean_shifts(principal_components(outputs, k)[0].numpy(), settings.min_share, grid)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    resampled = []
    for _ in range(settings.resamples):
        pick = torch.randint(0, outputs.shape[1], (outputs.shape[1],), generator=generator)
        resampled.append(
            [i for i, _ in mean_shifts(principal_components(outputs[:, pick], k)[0].numpy(), settings.min_share, grid)]
        )
    grid = grid.tolist()
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
    return judged(boundaries, settings.min_support), dynamics


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
