"""When the phase change comes: its step as a power law of what a sweep varied, with the jobs whose
phase change had not come by their last step kept as censored, and intervals that resample seeds.

The law (Aoyama, Wilcox & Schneider 2025, arXiv 2511.16893: steps ∝ (B·C)^-1/2; Musat et al. 2025,
arXiv 2511.01033: ∝ C^2) is read on log axes::

    ln t_j = c + Σ_k α_k ln x_jk + ε_j,    ε_j ~ N(0, σ²)

``t_j`` the job's step (or tokens: steps × tokens per step), ``x_jk`` the numeric values it was run
with. A job whose phase change had not come by its last step ``T_j`` says only ``t_j > T_j``: its
term of the likelihood is ``P(ln t_j > ln T_j) = 1 − Φ((ln T_j − μ_j) / σ)`` (right censoring; Tobin
1958 on ``ln t``, i.e. a log-normal accelerated-failure-time model). Dropping such jobs would bias
every exponent towards the values where the phase change comes early. lifelines' ``LogNormalAFTFitter``
fits the same model (the tests compare the two); it is written here on scipy because lifelines
would bring pandas, autograd and formulaic into the core for one likelihood of a few lines.

**Intervals** resample the seeds within each cell (a cell: one combination of the values; Efron &
Tibshirani 1993, the stratified bootstrap) and fit again; the interval is the estimate ± a Student t
quantile (jobs less cells degrees of freedom: what the scatter within cells has) times the resampled estimates' standard deviation. A cell of
``n`` seeds resampled has ``(n − 1) / n`` of its variance (at 3 seeds a plain percentile interval
covers ~82 % for 90 %), so that deviation is widened by ``sqrt(n̄ / (n̄ − 1))``, ``n̄`` the harmonic
mean of the cells' seeds. The bootstrap-t (studentized by each resample's own information) covered
less here, ~78 %: a resample with one seed drawn three times has too little scatter for its own
standard error. Coverage on planted laws: ``python -m bench.emergence_validity``.

**Whether one law fits**: each variable is fitted again as categories (one level per value, the others
as power laws); between neighbouring values ``v_i < v_(i+1)`` the local exponent is
``(γ_(i+1) − γ_i) / ln(v_(i+1) / v_i)``, with its interval from the same resamples. The law bends when
the interval of the last local exponent minus the first excludes 0 at 95 %. A value none of whose jobs
had the phase change bounds its neighbours' local exponents on one side only: they are reported censored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.special import log_ndtr
from scipy.stats import t as student_t

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)

LEVELS = (0.90, 0.95)
"""The intervals reported: 90 % (drawn, and the coverage target) and 95 % (what a verdict rejects at)."""


@dataclass(frozen=True)
class Observation:
    """One job: its numeric ``values`` (``{"data.batch_size": 32.0, ...}``), the step of its phase
    change or, ``censored``, the last step it ran to without one, and the tokens one step trains on."""

    values: dict[str, float]
    step: float
    censored: bool = False
    tokens_per_step: float = 1.0


@dataclass(frozen=True)
class Interval:
    """An estimate with its 90 % and 95 % intervals."""

    estimate: float
    low90: float
    high90: float
    low95: float
    high95: float

    def rejects(self, value: float) -> bool:
        """Whether ``value`` lies outside the 95 % interval."""
        return not self.low95 <= value <= self.high95

    def covers(self, value: float, level: float = 0.90) -> bool:
        low, high = (self.low90, self.high90) if level == 0.90 else (self.low95, self.high95)
        return low <= value <= high


@dataclass(frozen=True)
class LocalExponent:
    """The exponent between two neighbouring values of one variable; ``censored``: every job at one of
    them ran out of steps, so the data bound the exponent on one side only (no interval)."""

    low_value: float
    high_value: float
    exponent: Interval | None
    censored: bool = False


@dataclass
class Law:
    """``t ∝ Π x_k^α_k`` in one unit (``steps`` or ``tokens``): each exponent with its intervals, the
    scatter ``sigma`` of ``ln t`` about it, each variable's local exponents and whether the law bends
    (the last local exponent minus the first, with its interval)."""

    unit: str
    exponents: dict[str, Interval]
    intercept: float
    sigma: float
    jobs: int
    censored: int
    resamples: int  # resamples whose fit converged (of those drawn)
    local: dict[str, list[LocalExponent]] = field(default_factory=dict)
    bend: dict[str, Interval] = field(default_factory=dict)

    def bends(self, variable: str) -> bool:
        bend = self.bend.get(variable)
        return bend is not None and bend.rejects(0.0)

    def predict(self, values: dict[str, float]) -> float:
        """The law's step (or tokens) at ``values`` (the median of the log-normal scatter)."""
        return math.exp(self.intercept + sum(a.estimate * math.log(values[k]) for k, a in self.exponents.items()))


@dataclass(frozen=True)
class NoLaw:
    """Why no law was fitted, in one sentence."""

    reason: str


def fit_censored_log_normal(
    design: np.ndarray, log_t: np.ndarray, censored: np.ndarray, max_iterations: int = 100
) -> tuple[np.ndarray, float, np.ndarray] | None:
    """Maximum-likelihood ``(β [p], σ, cov(β) [p, p])`` of ``ln t = design β + ε``, ``ε ~ N(0, σ²)``,
    with ``t`` only known to exceed the given value where ``censored`` (``design [n, p]``, ``log_t
    [n]``, ``censored [n]`` bool); ``cov`` the inverse observed information. Newton's method in Olsen's
    (1978) parameters ``γ = β / σ``, ``τ = 1 / σ``, in which the log-likelihood is concave, with step
    halving; None where it does not converge (no maximum: e.g. an indicator whose every job is censored)."""
    if len(log_t) <= design.shape[1] or np.linalg.matrix_rank(design) < design.shape[1]:
        return None
    start, *_ = np.linalg.lstsq(design, log_t, rcond=None)
    spread = max(float(np.std(log_t - design @ start)), 1e-6)
    if not censored.any():  # the closed form: least squares, σ and the information as the likelihood's
        return start, spread, spread**2 * np.linalg.inv(design.T @ design)
    with np.errstate(all="ignore"):  # a fit that runs away overflows: caught as non-finite
        found = newton(
            design[~censored], log_t[~censored], design[censored], log_t[censored], start, spread, max_iterations
        )
    if found is None:
        return None
    gamma, tau, information = found
    jacobian = np.hstack([np.eye(len(gamma)) / tau, -gamma[:, None] / tau**2])  # d β / d (γ, τ), β = γ / τ
    try:
        covariance = jacobian @ np.linalg.inv(information) @ jacobian.T
    except np.linalg.LinAlgError:
        return None
    return gamma / tau, 1.0 / tau, covariance


def newton(x_seen, y_seen, x_cens, y_cens, start, spread, max_iterations):
    """:func:`fit_censored_log_normal`'s iterations: ``(γ, τ, −Hessian)`` at the maximum, or None."""
    n_seen, p = len(y_seen), x_seen.shape[1]

    def log_likelihood(gamma: np.ndarray, tau: float) -> float:
        r_seen, r_cens = tau * y_seen - x_seen @ gamma, tau * y_cens - x_cens @ gamma
        return n_seen * math.log(tau) - 0.5 * float(r_seen @ r_seen) + float(log_ndtr(-r_cens).sum())

    gamma, tau = start / spread, 1.0 / spread
    value = log_likelihood(gamma, tau)
    for _ in range(max_iterations):
        r_seen, r_cens = tau * y_seen - x_seen @ gamma, tau * y_cens - x_cens @ gamma
        h = np.exp(-0.5 * r_cens**2 - HALF_LOG_2PI - log_ndtr(-r_cens))  # −d log sf / dr (the inverse Mills ratio)
        w = h * (h - r_cens)  # −d² log sf / dr², ≥ 0
        gradient = np.append(x_seen.T @ r_seen + x_cens.T @ h, n_seen / tau - r_seen @ y_seen - h @ y_cens)
        hessian = np.empty((p + 1, p + 1))
        hessian[:p, :p] = -(x_seen.T @ x_seen) - (x_cens.T * w) @ x_cens
        hessian[:p, p] = hessian[p, :p] = x_seen.T @ y_seen + (x_cens.T * w) @ y_cens
        hessian[p, p] = -n_seen / tau**2 - y_seen @ y_seen - w @ y_cens**2
        if not (np.all(np.isfinite(hessian)) and np.all(np.isfinite(gradient))):
            return None  # a fit that runs away (no maximum)
        try:
            step = -np.linalg.solve(hessian, gradient)
        except np.linalg.LinAlgError:
            return None
        scale = 1.0
        while scale > 1e-8:
            new_gamma, new_tau = gamma + scale * step[:p], tau + scale * step[p]
            if new_tau > 0 and (new_value := log_likelihood(new_gamma, new_tau)) >= value - 1e-12:
                break
            scale /= 2
        else:
            return None
        gamma, tau, previous, value = new_gamma, new_tau, value, new_value
        if abs(value - previous) < 1e-12 and float(np.abs(scale * step).max()) < 1e-9:
            return gamma, tau, -hessian
    return None


def numeric_design(observations: list[Observation], variables: list[str]) -> np.ndarray:
    """``[n, 1 + len(variables)]``: a column of ones, then each variable's ``ln x``."""
    logs = [[math.log(o.values[k]) for k in variables] for o in observations]
    return np.hstack([np.ones((len(observations), 1)), np.array(logs, dtype=float).reshape(len(observations), -1)])


def categorical_design(
    observations: list[Observation], variables: list[str], variable: str
) -> tuple[np.ndarray, list[float]]:
    """``[n, levels + len(variables) − 1]``: one indicator per value of ``variable`` (no intercept),
    then every other variable's ``ln x``; and the values in increasing order."""
    levels = sorted({o.values[variable] for o in observations})
    indicators = np.array([[float(o.values[variable] == v) for v in levels] for o in observations])
    others = [k for k in variables if k != variable]
    logs = np.array([[math.log(o.values[k]) for k in others] for o in observations], dtype=float)
    return np.hstack([indicators, logs.reshape(len(observations), -1)]), levels


def cell_indices(observations: list[Observation], variables: list[str]) -> list[np.ndarray]:
    """The jobs of each cell (one combination of ``variables``' values): the seeds a resample draws from."""
    cells: dict[tuple, list[int]] = {}
    for i, o in enumerate(observations):
        cells.setdefault(tuple(o.values[k] for k in variables), []).append(i)
    return [np.array(members) for members in cells.values()]


def varying_variables(observations: list[Observation]) -> list[str]:
    """The variables with more than one value among ``observations``, in their first job's order."""
    names = list(dict.fromkeys(k for o in observations for k in o.values))
    return [k for k in names if len({o.values.get(k) for o in observations}) > 1]


def bootstrap_interval(estimate: float, resampled: np.ndarray, widen: float, dof: int) -> Interval:
    """``estimate ± t_dof · widen · sd(resampled)`` at 90 % and 95 % (NaN resamples left out)."""
    spread = widen * float(np.std(resampled[np.isfinite(resampled)], ddof=1))
    bounds = []
    for level in LEVELS:
        q = float(student_t.ppf(0.5 + level / 2, dof)) * spread
        bounds += [estimate - q, estimate + q]
    return Interval(float(estimate), *bounds)


def why_no_law(observations: list[Observation]) -> str | None:
    """One sentence when ``observations`` cannot carry a law: none, no variable with two values, no
    phase change in any job, a single seed in every cell, or too few phase changes for the exponents."""
    if not observations:
        return "no jobs"
    variables = varying_variables(observations)
    if not variables:
        return f"one value per variable in all {len(observations)} jobs: nothing varies to fit a law against"
    seen = sum(not o.censored for o in observations)
    if seen == 0:
        return f"no phase change in any of the {len(observations)} jobs (each ran out of steps): nothing to fit"
    cells = cell_indices(observations, variables)
    if all(len(c) == 1 for c in cells):
        return f"a single seed in each of the {len(cells)} cells: no interval can resample seeds (run 2 or more a cell)"
    if seen <= len(variables) + 1:
        return f"{seen} jobs with a phase change for {len(variables)} exponents and an intercept: too few to fit"
    return None


def fit_emergence_law(
    observations: list[Observation], unit: str = "steps", resamples: int = 1000, seed: int = 0
) -> Law | NoLaw:
    """The power law of the phase change's step (``unit="tokens"``: its tokens, steps × tokens per
    step) in every variable that varies among ``observations``, with intervals from ``resamples``
    draws of the seeds within each cell, and each variable's local exponents (the module docstring)."""
    if (reason := why_no_law(observations)) is not None:
        return NoLaw(reason)
    variables = varying_variables(observations)
    scale = np.array([o.tokens_per_step if unit == "tokens" else 1.0 for o in observations])
    log_t = np.log(np.array([o.step for o in observations], dtype=float) * scale)
    censored = np.array([o.censored for o in observations])
    design = numeric_design(observations, variables)
    fitted = fit_censored_log_normal(design, log_t, censored)
    if fitted is None:
        return NoLaw("the censored fit did not converge")
    beta, sigma, _ = fitted
    categorical = {k: categorical_design(observations, variables, k) for k in variables}
    everyone = np.arange(len(observations))
    local = {k: local_exponent_fit(d, levels, log_t, censored, everyone) for k, (d, levels) in categorical.items()}

    cells = cell_indices(observations, variables)
    sizes = np.array([len(c) for c in cells if len(c) > 1], dtype=float)
    n_bar = len(sizes) / float(np.sum(1 / sizes))
    # the resamples see only the scatter within cells: its degrees of freedom, jobs less cells
    widen, dof = math.sqrt(n_bar / (n_bar - 1)), max(len(observations) - len(cells), 1)
    rng = np.random.default_rng(seed)
    draws, local_draws = [], {k: [] for k in variables}
    for _ in range(resamples):
        idx = np.concatenate([rng.choice(c, len(c)) for c in cells])
        refit = fit_censored_log_normal(design[idx], log_t[idx], censored[idx])
        if refit is None:
            continue
        draws.append(refit[0])
        for k, (d, levels) in categorical.items():
            local_draws[k].append(local_exponent_fit(d, levels, log_t, censored, idx))
    if len(draws) < resamples // 2:
        return NoLaw(f"only {len(draws)} of {resamples} resampled fits converged: the data do not pin a law down")
    draws = np.array(draws)
    exponents = {k: bootstrap_interval(beta[1 + i], draws[:, 1 + i], widen, dof) for i, k in enumerate(variables)}
    law = Law(unit, exponents, float(beta[0]), sigma, len(observations), int(censored.sum()), len(draws))
    for k, (_, levels) in categorical.items():
        estimates, spread = local[k], np.array(local_draws[k])
        law.local[k] = [
            LocalExponent(levels[i], levels[i + 1], None, censored=True)
            if not math.isfinite(estimates[i]) or np.isfinite(spread[:, i]).mean() < 0.5
            else LocalExponent(levels[i], levels[i + 1], bootstrap_interval(estimates[i], spread[:, i], widen, dof))
            for i in range(len(levels) - 1)
        ]
        if len(levels) >= 3 and not any(e.censored for e in law.local[k]):
            law.bend[k] = bootstrap_interval(estimates[-1], spread[:, -1], widen, dof)
    return law


def local_exponent_fit(
    design: np.ndarray, levels: list[float], log_t: np.ndarray, censored: np.ndarray, idx: np.ndarray
) -> np.ndarray:
    """:func:`categorical_design`'s fit on the jobs ``idx``: the local exponents, then the last minus the
    first (the bend), ``[levels]``. NaN beside a value none of whose jobs had the phase change (the data
    bound it on one side only), or where the fit does not converge."""
    design, log_t, censored = design[idx], log_t[idx], censored[idx]
    n_levels = len(levels)
    seen = [j for j in range(n_levels) if ((design[:, j] == 1) & ~censored).any()]
    rows = design[:, seen].sum(axis=1) > 0
    kept = seen + list(range(n_levels, design.shape[1]))
    fitted = fit_censored_log_normal(design[rows][:, kept], log_t[rows], censored[rows]) if rows.any() else None
    effects = np.full(n_levels, np.nan)
    if fitted is not None:
        effects[seen] = fitted[0][: len(seen)]
    exponents = [(effects[i + 1] - effects[i]) / math.log(levels[i + 1] / levels[i]) for i in range(n_levels - 1)]
    return np.array([*exponents, exponents[-1] - exponents[0]])
