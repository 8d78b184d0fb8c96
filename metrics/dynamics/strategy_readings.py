"""Which strategy a model is using: its KL to each reference predictor (:mod:`data.reference_predictors`), the
mixture of them closest to it, and the steps where the closest one changes (Edelman et al. 2024, "The
Evolution of Statistical Induction Heads": the stage is the strategy closest to the model).

Directions, as the paper's ``test_last_token``: ``KL(strategy ‖ model)`` for each strategy,
``KL(truth ‖ model)`` and ``KL(truth ‖ strategy)`` (each strategy's own floor, the figure's horizontal
lines). The *mixture reading* is the ``w`` on the simplex minimising ``KL(model ‖ Σ_s w_s q_s)``,
convex in ``w``: a strategy the model uses in part gets weight long before it is the closest one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from data.reference_predictors import scored_mean

RISE_WEIGHT = 0.1
"""A strategy's mixture weight has started to rise at the first snapshot it reaches this and stays."""

PERSIST = 3
"""Snapshots a new closest strategy (or a risen weight) must hold for the change to count: one
snapshot's flicker where two strategies cross is not a switch."""

SMOOTHING = 5
"""Snapshots in the centred moving average of each KL curve before the closest strategy is read: noise
in one snapshot's held-out estimate should not flip it."""

SWITCH_RESAMPLES = 200
"""Bootstrap resamples of the held-out sequences behind a switch step's interval."""


def kl_rows(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """``Σ_v p (log p - log q)`` over the last axis, ``0 log 0 = 0``: ``[...]``."""
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def safe_log(p: Tensor) -> Tensor:
    """``log p`` with ``log 0`` a finite stand-in (``kl_rows`` drops those entries): ``p``'s shape."""
    return p.clamp_min(1e-300).log()


def strategy_kls(
    strategies: dict[str, Tensor],
    log_model: Tensor,
    scored: Tensor | None = None,
    log_strategies: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """``KL(q_s ‖ model)`` per sequence ``[b]`` (mean over its scored positions, ``scored [b, p]``;
    None: every position) for each strategy ``q_s [b, p, V]``; ``log_model [b, p, V]``: the model's
    log-probabilities of the task tokens. ``log_strategies``: each ``safe_log(q_s)``, where the caller
    keeps them (a tracker reads the same strategies at every snapshot)."""
    logs = log_strategies or {name: safe_log(q) for name, q in strategies.items()}
    return {name: scored_mean(kl_rows(q, logs[name], log_model), scored) for name, q in strategies.items()}


@dataclass(frozen=True)
class TokenGroups:
    """The strategies' values per position with tokens merged where every strategy agrees (copy and
    induction give most tokens the same values): KLs to the strategies and the mixture's objective
    need only each group's sums. ``group [N, V]`` (a group id per token), ``profile [N, G, S]`` (the
    strategies' value of one token of the group; 0 for padding groups)."""

    group: Tensor
    profile: Tensor

    def sums(self, values: Tensor) -> Tensor:
        """``values [N, V]`` summed over each group's tokens: ``[N, G]``."""
        return torch.zeros(self.profile.shape[:2], dtype=values.dtype, device=values.device).scatter_add_(
            1, self.group, values
        )

    def first(self, strategies: int) -> TokenGroups:
        """The same groups with only the first ``strategies`` columns of the profile (groups that the
        others split stay split: the sums over them are the same)."""
        return TokenGroups(self.group, self.profile[..., :strategies])


def token_groups(strategies: Tensor) -> TokenGroups:
    """``strategies [S, N, V]`` (flattened positions) -> :class:`TokenGroups`: tokens with equal
    values under every strategy share a group (a random projection of the profile, sorted per row)."""
    S, N, V = strategies.shape
    generator = torch.Generator(device="cpu").manual_seed(0)
    key = torch.einsum(
        "snv,s->nv", strategies.double(), torch.rand(S, generator=generator, dtype=torch.float64, device="cpu") + 1
    )
    order = key.argsort(-1)
    sorted_key = key.gather(-1, order)
    new = torch.ones(N, V, dtype=torch.long, device="cpu")
    new[:, 1:] = (sorted_key[:, 1:] != sorted_key[:, :-1]).long()
    ids_sorted = new.cumsum(-1) - 1
    group = torch.empty_like(ids_sorted).scatter_(-1, order, ids_sorted)
    G = int(group.max()) + 1
    profile = torch.zeros(N, G, S, dtype=torch.float64, device="cpu")
    profile.scatter_(1, group[..., None].expand(N, V, S), strategies.double().permute(1, 2, 0))
    return TokenGroups(group, profile)


def negative_entropies(strategies: Tensor) -> Tensor:
    """``Σ_v q log q`` of each of ``strategies [S, N, V]`` at each position, ``0 log 0 = 0``: ``[N, S]``."""
    return kl_rows(strategies, safe_log(strategies), torch.zeros_like(strategies)).T


def grouped_kls(groups: TokenGroups, negative_entropy: Tensor, log_model: Tensor) -> Tensor:
    """``KL(q_s ‖ model)`` at each of N positions for each strategy: ``[N, S]``, as ``Σ_v q_s log q_s``
    (``negative_entropy [N, S]``, :func:`negative_entropies`) less ``Σ_g q_s(g) Σ_{v∈g} log model``
    (``log_model [N, V]``): two sums over the tokens' groups instead of one per strategy over V."""
    return negative_entropy - torch.einsum("ng,ngs->ns", groups.sums(log_model), groups.profile)


EM_STEPS = 10
"""EM updates of the mixture weights before SLSQP polishes them (:func:`mixture_weights`)."""


def load_solver() -> None:
    """Import SciPy's optimizer (:func:`mixture_weights`'s SLSQP, 0.6-0.8 s after torch) ahead of the first
    reading. A run's tracker calls it when it is built, while W&B opens its run on a thread of its own
    (``records/wandb_run.py``), so that the first snapshot does not pay for it. Not at the module's top:
    a process that imports this module without reading strategies (``conf.schema`` does) loads no SciPy."""
    import scipy.optimize  # noqa: F401


def mixture_weights(model: Tensor, groups: TokenGroups, log_model: Tensor | None = None) -> tuple[np.ndarray, float]:
    """The weights ``w [S]`` on the simplex whose mixture ``Σ_s w_s q_s`` is closest to ``model [N, V]``
    (probabilities of the task tokens, rows summing to 1; ``log_model``: their logs, where the caller
    has them) in ``KL(model ‖ mixture)`` averaged over the N positions, and that KL. Solved with SciPy's
    SLSQP (a convex problem in S variables: only the groups' masses enter, ``[N, G]``), started after
    ``EM_STEPS`` EM updates of the mixture proportions from equal weights (Dempster, Laird & Rubin 1977:
    ``w_s <- w_s · mean_n Σ_g mass q_s / mix``, each a step downhill on the simplex), which leave SLSQP
    2 iterations instead of 15 (0.56 against 1.21 ms a reading at the default shape; the same optimum
    to 1e-7 in the weights, 5e-14 nats in the KL)."""
    model = model.double()
    mass = groups.sums(model).numpy()
    profile = groups.profile.numpy()  # (N, G, S)
    N, _, S = profile.shape
    used = mass > 0
    log_model = model.clamp_min(1e-300).log() if log_model is None else log_model.double()
    entropy_part = float(torch.where(model > 0, model * log_model, 0.0).sum() / N)

    def objective(w: np.ndarray) -> tuple[float, np.ndarray]:
        mix = np.maximum(profile @ w, 1e-300)  # (N, G)
        value = entropy_part - float((mass * np.log(mix))[used].sum()) / N
        gradient = -np.einsum("ng,ngs->s", np.where(used, mass / mix, 0.0), profile) / N
        return value, gradient

    from scipy.optimize import minimize  # not at the top: see load_solver

    start = np.full(S, 1.0 / S)
    for _ in range(EM_STEPS):  # the EM update is w ⊙ (-∇): the gradient's terms are the responsibilities
        start = start * -objective(start)[1]
        start /= start.sum()
    solved = minimize(
        objective,
        start,
        jac=True,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * S,
        constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1.0, "jac": lambda w: np.ones_like(w)}],
        options={"ftol": 1e-13, "maxiter": 200},
    )
    weights = np.clip(solved.x, 0.0, None)
    weights /= weights.sum()
    return weights, objective(weights)[0]


@dataclass(frozen=True)
class Switch:
    """A change of the closest strategy, ``source -> target``, at ``step``; with resamples of the
    held-out sequences, the 2.5-97.5 % range of its step (``low``, ``high``) and the share of resamples
    that have it (``found``)."""

    source: str
    target: str
    step: float
    low: float = float("nan")
    high: float = float("nan")
    found: float = float("nan")

    @property
    def label(self) -> str:
        return f"{self.source} → {self.target}"


def smoothed(values: np.ndarray, window: int = SMOOTHING) -> np.ndarray:
    """``values [n_steps, ...]`` averaged along axis 0 over a centred window of ``window`` snapshots,
    narrowed symmetrically near the ends (the first and last snapshots are their own), so a stage as
    short as one snapshot at the start of a run is not averaged away."""
    n = len(values)
    half = np.minimum(np.minimum(np.arange(n), np.arange(n)[::-1]), window // 2)  # (n,)
    cumulative = np.concatenate([np.zeros((1, *values.shape[1:])), np.cumsum(values, axis=0)])
    lows, highs = np.arange(n) - half, np.arange(n) + half + 1
    return (cumulative[highs] - cumulative[lows]) / (highs - lows).reshape(-1, *([1] * (values.ndim - 1)))


def closest(kls: np.ndarray, window: int = SMOOTHING) -> np.ndarray:
    """``kls [n_steps, S]`` -> the index of the closest strategy at each step ``[n_steps]``, read from
    each curve's centred moving average over ``window`` snapshots (:func:`smoothed`)."""
    return np.argmin(smoothed(kls, window), axis=1)


def switches(steps: np.ndarray, nearest: np.ndarray, names: list[str], persist: int = PERSIST) -> list[Switch]:
    """The steps where the closest strategy changes and then holds for ``persist`` snapshots, in order
    (a change in the run's last ``persist - 1`` snapshots is not confirmed, so not reported)."""
    found: list[Switch] = []
    current = int(nearest[0])
    for i in range(1, len(nearest) - persist + 1):
        candidate = int(nearest[i])
        if candidate != current and np.all(nearest[i : i + persist] == candidate):
            found.append(Switch(names[current], names[candidate], float(steps[i])))
            current = candidate
    return found


def switches_with_intervals(
    steps: np.ndarray,
    per_sequence: np.ndarray,
    names: list[str],
    persist: int = PERSIST,
    resamples: int = SWITCH_RESAMPLES,
    seed: int = 0,
) -> list[Switch]:
    """:func:`switches` of the mean over sequences, ``per_sequence [n_steps, S, b]`` (each sequence's
    ``KL(strategy ‖ model)``), each with the range of its step over ``resamples`` bootstrap resamples
    of the b sequences (the k-th ``A -> B`` of a resample matched with the k-th of the run)."""
    point = switches(steps, closest(per_sequence.mean(-1)), names, persist)
    rng = np.random.default_rng(seed)
    b = per_sequence.shape[-1]
    matched: list[list[float]] = [[] for _ in point]
    for _ in range(resamples):
        pick = rng.integers(0, b, size=b)
        seen: dict[str, int] = {}
        by_label: dict[tuple[str, int], float] = {}
        for switch in switches(steps, closest(per_sequence[..., pick].mean(-1)), names, persist):
            seen[switch.label] = seen.get(switch.label, 0) + 1
            by_label[(switch.label, seen[switch.label])] = switch.step
        count: dict[str, int] = {}
        for i, switch in enumerate(point):
            count[switch.label] = count.get(switch.label, 0) + 1
            if (switch.label, count[switch.label]) in by_label:
                matched[i].append(by_label[(switch.label, count[switch.label])])
    result = []
    for switch, found in zip(point, matched):
        low, high = np.percentile(found, [2.5, 97.5]) if found else (float("nan"), float("nan"))
        result.append(
            Switch(switch.source, switch.target, switch.step, float(low), float(high), len(found) / resamples)
        )
    return result


def rise_steps(
    steps: np.ndarray, weights: np.ndarray, names: list[str], threshold: float = RISE_WEIGHT, persist: int = PERSIST
) -> dict[str, float]:
    """For each strategy not already at ``threshold`` at the first snapshot, the first step where its
    mixture weight (``weights [n_steps, S]``) reaches it and holds for ``persist`` snapshots."""
    rises = {}
    for s, name in enumerate(names):
        above = weights[:, s] >= threshold
        if above[0]:
            continue
        for i in range(1, len(above) - persist + 1):
            if np.all(above[i : i + persist]):
                rises[name] = float(steps[i])
                break
    return rises
