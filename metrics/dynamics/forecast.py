"""Forecast a run's phase change from inside it: the midpoint step of the repeated-token loss's fall,
with an 80 % interval and the probability that it comes by ``max_steps``, from the run's own series so far.

**The rule** (model-free, what runs without a fitted forecaster). On its plateau the repeated-token
loss leaves its first level ``L0`` as a trajectory leaves a saddle: the distance fallen, ``d(t) = L0 −
L(t)``, grows about exponentially (the linearised dynamics about a saddle; Saxe, McClelland & Ganguli
2014, and the plateau escape of Zucchet et al. 2025, arXiv 2505.17863). The rule fits ``ln d`` against
the step over the latter half of the series so far (``[t/2, t]``, the smoothed loss) and extrapolates to
the step where ``d`` reaches ``L0 / 2``: the midpoint of a fall from ``L0`` to about zero (repeated
tokens are predictable once copied). Its interval comes from the growth rate's standard error, the
points counted as the series' length over the smoothing window (smoothed points are not independent).
Its window was chosen among three on the sweeps it is judged on (docs/forecast.md says so beside its errors).

**A fitted forecaster** (``python -m analysis.forecast fit SWEEP_DIR``) corrects the rule from a
sweep's runs: a ridge regression of ``ln(midpoint / t)`` on the rule's own forecast and the precursors
(:data:`FEATURES`), optionally with the prior of a power law fitted to the same sweep's midpoints; its
80 % interval and ``p_before_end`` come from the training rows' residuals (split-conformal style:
their 10 % and 90 % quantiles, their empirical distribution). Written by hand: no library forecasts a
phase change, and the regression is four lines of numpy.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from metrics.dynamics.phase_change import SMOOTHING_WINDOW

LOSS = "loss/repeated"
PRECURSORS = {"prev_token_rise": "heads/prev_token/top", "induction_rise": "heads/induction/top"}
"""Precursor features: a series' rise since its first snapshot (smoothed)."""
SERIES = (LOSS, *PRECURSORS.values())
"""The tracker keys a forecast reads."""
FEATURES = ("log_step", "fallen", "growth", "rule", "rule_defined", *PRECURSORS)
"""What a fitted forecaster regresses ``ln(midpoint / t)`` on, at step ``t``: ``ln t``; the fraction of
``L0`` fallen; the rule's growth rate times ``t`` (e-foldings over the run so far; 0 where there is none);
``ln(rule's midpoint / t)`` (capped at :data:`RULE_CAP`; the cap where the rule has none) and whether it
has one; each precursor's rise."""
RULE_CAP = 3.0
"""``ln(midpoint / t)`` at most this in the features (a midpoint 20 times the step so far)."""
LEVEL = 0.80
"""The forecast interval's level."""
Z_LEVEL = 1.2815515655446004
"""The standard normal's quantile at ``(1 + LEVEL) / 2``."""
FORECAST_BEHAVIOURS = ("induction",)
"""The tasks (by their reader's behaviour, ``Task.reader_behaviour``) whose repeated-token loss falls from
``L0`` to about zero at the phase change, where the rule's target holds: repeated tokens, triggers and
copied sentences; not in-context chains, whose loss falls to the chain's entropy."""
FORECAST_KEYS = ("forecast/midpoint_step", "forecast/low", "forecast/high", "forecast/p_before_end")
WAYS = (0.25, 0.50, 0.75)
"""Where a run's closing line reads its forecasts: this fraction of the way to the true midpoint."""
FIRST_FRACTION = 0.1
"""A fitted forecaster learns from each run's snapshots from this fraction of the way to its midpoint on."""
MIN_FALL = 0.01
"""The rule reads ``ln d`` only where the loss has fallen at least this fraction of ``L0``."""


@dataclass(frozen=True)
class Forecast:
    """The midpoint step forecast at ``step`` (``inf``: not before the fall's growth turns; NaN: no
    forecast yet), its 80 % interval and the probability that it comes by ``max_steps``."""

    step: float
    midpoint: float
    low: float
    high: float
    p_before_end: float

    def metrics(self) -> dict[str, float]:
        return dict(zip(FORECAST_KEYS, (self.midpoint, self.low, self.high, self.p_before_end)))


def no_induction_circuit(n_layers: int, n_heads: int, silenced: set[tuple[int, int]]) -> str | None:
    """Why a model cannot form an induction circuit, or None where it can. An induction head's keys read
    a previous-token head of an earlier layer (K-composition; Elhage et al. 2021, Olsson et al. 2022): it
    needs two layers and a head below the last that is not silenced (``silenced``: ``(layer, head)``
    ablated for the whole run, :func:`models.interventions.silenced_throughout`). The forecast is of
    that circuit's cliff; where it cannot form, none is made (a loss that falls by copying is not it)."""
    if n_layers < 2:
        return f"a {n_layers}-layer model has no earlier layer for an induction head to read"
    if all((layer, head) in silenced for layer in range(n_layers - 1) for head in range(n_heads)):
        return "every head below the last layer is ablated from step 0 to the end"
    return None


def smoothed(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average ``[n] -> [n]`` whose window shrinks at the edges: the last point averages
    only points up to it (what :func:`metrics.dynamics.phase_change.smooth` does, in numpy)."""
    if window <= 1:
        return values.astype(float)
    kernel = np.ones(window)
    pad = window // 2
    padded_sum = np.convolve(np.pad(values.astype(float), pad), kernel, "valid")
    counts = np.convolve(np.pad(np.ones(len(values)), pad), kernel, "valid")
    return (padded_sum / counts)[: len(values)]


@dataclass(frozen=True)
class Growth:
    """The fitted escape ``ln d(t) = intercept + rate · t`` over ``[t/2, t]``, the rate's standard error."""

    rate: float
    intercept: float
    rate_se: float


def escape_growth(steps: np.ndarray, loss: np.ndarray, window: int) -> Growth | None:
    """The exponential growth of the distance fallen (``steps [n]``, ``loss [n]``, smoothed over ``window``
    points) over the latter half of the steps, or None with under three points that have fallen
    :data:`MIN_FALL` of ``L0``."""
    level = smoothed(loss, window)
    distance = level[0] - level
    t = steps[-1]
    keep = (steps >= t / 2) & (distance > MIN_FALL * level[0])
    if keep.sum() < 3:
        return None
    x, y = steps[keep], np.log(distance[keep])
    design = np.column_stack([x, np.ones_like(x)])
    (rate, intercept), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ np.array([rate, intercept])
    points = max(len(x) / max(window, 1), 2.0 + 1e-9)  # independent points: the smoothing joins `window`
    spread = math.sqrt(float(residual @ residual) / max(len(x) - 2, 1))
    rate_se = spread / math.sqrt(float(((x - x.mean()) ** 2).sum())) * math.sqrt(len(x) / points)
    return Growth(float(rate), float(intercept), float(rate_se))


def rule_forecast(steps: np.ndarray, loss: np.ndarray, max_steps: float, window: int = SMOOTHING_WINDOW) -> Forecast:
    """The model-free rule's forecast at the last step (module docstring): ``steps [n]`` and ``loss [n]``
    the repeated-token loss so far. Where the loss has not yet fallen :data:`MIN_FALL` of ``L0`` at three
    points of ``[t/2, t]``, none (every field NaN); where its fall is not growing, the midpoint is ``inf``
    and ``p_before_end`` the chance that the growth rate is in truth high enough."""
    return rule_from_growth(steps, loss, max_steps, window, escape_growth(steps, loss, window))


def rule_from_growth(
    steps: np.ndarray, loss: np.ndarray, max_steps: float, window: int, growth: Growth | None
) -> Forecast:
    """:func:`rule_forecast` from the escape's ``growth`` already fitted to these steps (:func:`escape_growth`)."""
    t = float(steps[-1])
    if growth is None:  # nothing to read yet: no forecast
        return Forecast(t, math.nan, math.nan, math.nan, math.nan)
    target = math.log(smoothed(loss, window)[0] / 2)
    to_go = target - (growth.intercept + growth.rate * t)  # ln d still to grow
    if to_go <= 0:
        return Forecast(t, t, t, t, 1.0)

    def midpoint(rate: float) -> float:
        return t + to_go / rate if rate > 0 else math.inf

    z = Z_LEVEL
    needed = to_go / (max_steps - t) if max_steps > t else math.inf  # the rate that reaches it by max_steps
    p = normal_above((needed - growth.rate) / growth.rate_se) if growth.rate_se > 0 else float(growth.rate >= needed)
    return Forecast(
        t,
        midpoint(growth.rate),
        midpoint(growth.rate + z * growth.rate_se),
        midpoint(growth.rate - z * growth.rate_se),
        p,
    )


def normal_above(z: float) -> float:
    """``P(Z > z)`` for a standard normal ``Z`` (scipy.stats, 0.3 s to import, is not on a run's path)."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def features(steps: np.ndarray, series: dict[str, np.ndarray], max_steps: float, window: int) -> np.ndarray:
    """:data:`FEATURES` ``[len(FEATURES)]`` at the last of ``steps [n]``; ``series``: each of :data:`SERIES`
    ``[n]`` at those steps (a precursor the run did not track: zeros)."""
    t = float(steps[-1])
    loss = series[LOSS]
    level = smoothed(loss, window)
    growth = escape_growth(steps, loss, window)
    rule = rule_from_growth(steps, loss, max_steps, window, growth)
    defined = math.isfinite(rule.midpoint)
    rises = []
    for key in PRECURSORS.values():
        values = series.get(key)
        rises.append(0.0 if values is None else float(smoothed(values, window)[-1] - smoothed(values, window)[0]))
    return np.array(
        [
            math.log(t),
            (level[0] - level[-1]) / level[0],
            max(growth.rate, 0.0) * t if growth is not None else 0.0,
            min(math.log(max(rule.midpoint, t) / t), RULE_CAP) if defined else RULE_CAP,
            float(defined),
            *rises,
        ]
    )


@dataclass
class PriorLaw:
    """``ln midpoint = intercept + Σ exponent_k ln x_k + level[stratum]``: a power law in the sweep's
    numeric settings (``{"data.batch_size": -0.5}``), one offset per value of its other swept settings."""

    intercept: float
    exponents: dict[str, float]
    sigma: float = 0.0  # the scatter of ln midpoint about the law
    strata: list[str] = field(default_factory=list)  # the non-numeric settings it splits by
    offsets: dict[str, float] = field(default_factory=dict)  # "fixed" -> 0.0 (the first value is 0)

    def predict(self, settings: dict[str, str]) -> float | None:
        """The law's midpoint for a run's settings (``{"data.batch_size": "8", ...}``), None where one is missing
        or a stratum is one it never saw."""
        try:
            log_t = self.intercept + sum(a * math.log(float(settings[k])) for k, a in self.exponents.items())
            key = "|".join(str(settings[k]) for k in self.strata)
        except (KeyError, ValueError):
            return None
        if self.strata and key not in self.offsets:
            return None
        return math.exp(log_t + self.offsets.get(key, 0.0))


def fit_prior_law(
    settings: list[dict[str, str]], midpoints: list[float], censored: list[bool], numeric: list[str], strata: list[str]
) -> PriorLaw | None:
    """The censored log-normal power law (:func:`metrics.dynamics.emergence_law.fit_censored_log_normal`)
    of ``midpoints`` (a censored one: the run's ``max_steps``) on ``numeric`` settings, an offset per
    value of ``strata``; None where it cannot be fitted."""
    from metrics.dynamics.emergence_law import fit_censored_log_normal  # scipy.stats: only when fitting

    if not numeric:
        return None
    keys = sorted({"|".join(s[k] for k in strata) for s in settings}) if strata else [""]
    rows = []
    for s in settings:
        key = "|".join(s[k] for k in strata) if strata else ""
        rows.append([1.0, *(math.log(float(s[k])) for k in numeric), *(float(key == k) for k in keys[1:])])
    found = fit_censored_log_normal(np.array(rows), np.log(midpoints), np.array(censored))
    if found is None:
        return None
    beta, sigma = found[0], float(found[1])
    offsets = {keys[0]: 0.0, **{k: float(b) for k, b in zip(keys[1:], beta[1 + len(numeric) :])}} if strata else {}
    exponents = dict(zip(numeric, map(float, beta[1 : 1 + len(numeric)])))
    return PriorLaw(float(beta[0]), exponents, sigma, strata, offsets)


SHAPE_KEYS = ("n_layers", "n_heads", "d_model", "d_head", "d_vocab")
"""The model settings a forecaster is tied to (``model.*``): another shape learns on another clock."""


def shape_of(model: dict) -> dict:
    """The :data:`SHAPE_KEYS` of a config's ``model`` section."""
    return {k: model[k] for k in SHAPE_KEYS if k in model}


@dataclass
class Forecaster:
    """A forecaster fitted on one sweep (module docstring): for runs of its ``task`` and model ``shape``.
    ``law``: the prior whose ``ln(law midpoint / t)`` is a further feature (None: none)."""

    task: str
    shape: dict
    coefficients: list[float]  # intercept, then one per feature (standardised)
    means: list[float]
    scales: list[float]
    residuals: list[float]  # of the training rows, sorted
    law: PriorLaw | None = None
    runs: int = 0
    rows: int = 0
    window: int = SMOOTHING_WINDOW
    features: list[str] = field(default_factory=lambda: list(FEATURES))

    def forecast(self, steps, series, max_steps: float, settings: dict[str, str] | None = None) -> Forecast:
        """The forecast at the last of ``steps [n]`` (``series``: :func:`features`'; ``settings``: the run's,
        for the law)."""
        return self.from_features(
            features(steps, series, max_steps, self.window), float(steps[-1]), max_steps, settings
        )

    def from_features(self, row: np.ndarray, t: float, max_steps: float, settings: dict[str, str] | None) -> Forecast:
        """The forecast at step ``t`` from its :func:`features` ``row``."""
        log_ratio = float(np.dot(self.coefficients, self.design(row, t, settings)))
        residuals = np.array(self.residuals)
        low, high = np.quantile(residuals, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
        p = float(np.mean(log_ratio + residuals <= math.log(max_steps / t))) if max_steps > t else 0.0
        return Forecast(t, t * math.exp(log_ratio), t * math.exp(log_ratio + low), t * math.exp(log_ratio + high), p)

    def design(self, row: np.ndarray, t: float, settings: dict[str, str] | None) -> np.ndarray:
        """``[1 + features]``: 1, then the standardised features (and the law's, where it has one)."""
        if self.law is not None:
            law = self.law.predict(settings or {})
            row = np.append(row, math.log(law / t) if law else 0.0)
        return np.concatenate([[1.0], (row - np.array(self.means)) / np.array(self.scales)])

    def refusal(self, task: str, shape: dict) -> str | None:
        """Why a run of ``task`` and model ``shape`` cannot use this forecaster, in one line (None: it can)."""
        if task != self.task:
            return f"it was fitted on task {self.task!r}, this run's is {task!r}"
        differ = {k: (self.shape[k], shape.get(k)) for k in self.shape if self.shape[k] != shape.get(k)}
        if differ:
            return (
                "it was fitted on another model shape ("
                + ", ".join(f"model.{k}={a} there, {b} here" for k, (a, b) in differ.items())
                + ")"
            )
        return None

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"kind": "phase_change_forecaster", **asdict(self)}, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Forecaster:
        """The forecaster in ``path``; ValueError (one line) where it is not one or is damaged."""
        try:
            record = json.loads(Path(path).read_text())
            if record.pop("kind", None) != "phase_change_forecaster":
                raise ValueError("not a phase-change forecaster (no kind: phase_change_forecaster)")
            law = record.pop("law", None)
            return cls(**record, law=PriorLaw(**law) if law else None)
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file") from None
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{path}: damaged or not a forecaster ({error})".splitlines()[0]) from None


@dataclass(frozen=True)
class History:
    """One run's series (``steps [n]``, each of :data:`SERIES` ``[n]``), its ``max_steps``, settings and true
    midpoint (None: no phase change by ``max_steps``)."""

    steps: np.ndarray
    series: dict[str, np.ndarray]
    max_steps: float
    settings: dict[str, str]
    midpoint: float | None

    def upto(self, i: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The first ``i + 1`` snapshots."""
        return self.steps[: i + 1], {k: v[: i + 1] for k, v in self.series.items()}


def features_along(history: History, window: int = SMOOTHING_WINDOW) -> np.ndarray:
    """:func:`features` ``[n, F]`` at every snapshot of a run (NaN at its first two)."""
    rows = np.full((len(history.steps), len(FEATURES)), np.nan)
    for i in range(2, len(history.steps)):
        steps, series = history.upto(i)
        rows[i] = features(steps, series, history.max_steps, window)
    return rows


def training_rows(history: History, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of a run's :func:`features_along` ``rows [n, F]``, those from :data:`FIRST_FRACTION` of the way to its
    midpoint until just before it, and their targets ``ln(midpoint / t)``."""
    t = history.steps
    keep = (t >= FIRST_FRACTION * history.midpoint) & (t < history.midpoint) & ~np.isnan(rows).any(axis=1)
    return rows[keep], np.log(history.midpoint / t[keep])


def fit_forecaster(
    histories: list[History],
    task: str,
    shape: dict,
    law: PriorLaw | None = None,
    window: int = SMOOTHING_WINDOW,
    ridge: float = 1e-2,
    along: list[np.ndarray] | None = None,
) -> Forecaster:
    """A ridge regression (penalty ``ridge`` per row, intercept free) of ``ln(midpoint / t)`` on the
    standardised features of every run with a midpoint; raises ValueError when none has one. ``along``:
    each history's :func:`features_along`, where already computed."""
    along = along if along is not None else [None] * len(histories)
    pairs = [(h, a) for h, a in zip(histories, along) if h.midpoint is not None]
    if not pairs:
        raise ValueError(f"none of the {len(histories)} runs has a phase change to learn from")
    with_midpoint = [h for h, _ in pairs]
    blocks = []
    for h, a in pairs:
        rows, targets = training_rows(h, a if a is not None else features_along(h, window))
        if law is not None:
            prior = law.predict(h.settings)
            rows = np.column_stack([rows, [math.log(prior / t) if prior else 0.0 for t in np.exp(rows[:, 0])]])
        blocks.append((rows, targets))
    x = np.vstack([b[0] for b in blocks])
    y = np.concatenate([b[1] for b in blocks])
    means, scales = x.mean(axis=0), x.std(axis=0)
    scales[scales == 0] = 1.0
    design = np.column_stack([np.ones(len(x)), (x - means) / scales])
    penalty = ridge * len(x) * np.eye(design.shape[1])
    penalty[0, 0] = 0.0
    coefficients = np.linalg.solve(design.T @ design + penalty, design.T @ y)
    residuals = np.sort(y - design @ coefficients)
    return Forecaster(
        task,
        shape,
        coefficients.tolist(),
        means.tolist(),
        scales.tolist(),
        residuals.tolist(),
        law,
        len(with_midpoint),
        len(x),
        window,
        [*FEATURES, "law"] if law is not None else list(FEATURES),
    )


def forecasts_along(
    history: History, forecaster: Forecaster | None, window: int = SMOOTHING_WINDOW, along: np.ndarray | None = None
) -> list[Forecast]:
    """The forecast at each snapshot of a run (from its third) by ``forecaster`` or, None, the rule: what
    the tracker logs, replayed from the run's files (``along``: its :func:`features_along`, if computed)."""
    if forecaster is None:
        forecasts = []
        for i in range(2, len(history.steps)):
            steps, series = history.upto(i)
            forecasts.append(rule_forecast(steps, series[LOSS], history.max_steps, window))
        return forecasts
    along = along if along is not None else features_along(history, forecaster.window)
    return [
        forecaster.from_features(along[i], float(history.steps[i]), history.max_steps, history.settings)
        for i in range(2, len(history.steps))
    ]


def forecast_at(forecasts: list[Forecast], step: float) -> Forecast | None:
    """The last forecast made at or before ``step`` (None: none yet)."""
    made = [f for f in forecasts if f.step <= step and not math.isnan(f.midpoint)]
    return made[-1] if made else None


def past_midpoint(loss: np.ndarray, window: int) -> bool:
    """Whether the smoothed loss ``[n]`` has fallen to half its first level: the rule's target, the fall's
    midpoint passed (a forecast after it forecasts the past)."""
    level = smoothed(loss, window)
    return bool(level[-1] <= level[0] / 2)
