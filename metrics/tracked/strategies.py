"""Which strategy the model is using (:mod:`metrics.dynamics.strategies`), on fresh held-out sequences
of the run's task: its KL to each of the task's reference predictors (:meth:`data.task.Task.reference`),
its KL to the truth where the task knows it, the closest strategy and the mixture reading."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.strategies import HELD_OUT_STRATEGY_IDS, ReferencePredictions, scored_mean
from metrics.dynamics.strategies import TokenGroups, kl_rows, mixture_weights, safe_log, strategy_kls, token_groups
from metrics.tracked.base import Output, ProbeRun, Scalar, Stored, TrackedQuantity

PREFIX = "strategies/"
PER_SEQUENCE = "per_sequence/"  # strategies/per_sequence/NAME in the tensor store: [b] per snapshot


@dataclass
class StrategiesOptions:
    """``tracker.strategies.*``: every ``every_n_steps`` steps (0: off), on ``sequences`` held-out
    sequences of the task (drawn once, the same at every snapshot)."""

    every_n_steps: int = (
        20  # a switch's step to 20 steps; ~2.5 ms a reading at the default shape (docs/configuration.md)
    )
    sequences: int = 16

    def problems(self) -> list[str]:
        problems = (
            [] if self.every_n_steps >= 0 else [f"every_n_steps={self.every_n_steps} must be >= 0 (0 turns it off)"]
        )
        if self.sequences < 2:
            problems.append(f"sequences={self.sequences} must be >= 2 (a switch's interval resamples them)")
        return problems


@dataclass(frozen=True)
class StrategyReading:
    """One snapshot's reading: ``kl[name]`` = KL(strategy ‖ model) per sequence ``[b]``, ``truth_kl``
    = KL(truth ‖ model) per sequence (None without a truth), the mixture ``weights [S]`` and its
    ``KL(model ‖ mixture)``, in the strategies' order ``names``."""

    names: tuple[str, ...]
    kl: dict[str, np.ndarray]
    truth_kl: np.ndarray | None
    weights: np.ndarray
    mixture_kl: float

    @property
    def closest(self) -> int:
        return int(np.argmin([self.kl[name].mean() for name in self.names]))


class Strategies(TrackedQuantity):
    """``strategies/kl/NAME`` (KL(strategy ‖ model), nats, mean over the held-out sequences' scored
    positions), ``strategies/kl/truth``, ``strategies/line/NAME`` (KL(truth ‖ strategy): each
    strategy's floor), ``strategies/closest`` (index into the strategies' order), ``strategies/weight/NAME``
    and ``strategies/mixture_kl`` (the mixture reading); ``strategies/per_sequence/NAME`` (and ``/truth``)
    in the tensor store, ``[b]`` per snapshot, for the switches' intervals. Measured with the run's interventions on."""

    name = "strategies"
    label = "strategies"
    Options = StrategiesOptions

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.reference: ReferencePredictions | None = None
        self.lines: dict[str, float] = {}  # KL(truth ‖ strategy) by name: the figure's horizontal lines
        self.n_random = 0

    def for_task(self, task, n_random: int) -> Strategies:
        """Draw the held-out sequences of ``task`` and its strategies on them (once)."""
        if self.enabled:
            ids = np.arange(HELD_OUT_STRATEGY_IDS, HELD_OUT_STRATEGY_IDS + self.options.sequences)
            self.use(task.reference(ids, n_random), n_random)
        return self

    def use(self, reference: ReferencePredictions, n_random: int) -> Strategies:
        """Score on ``reference`` (held-out sequences and their strategies) instead."""
        self.reference, self.n_random = reference, n_random
        stacked = torch.stack(list(reference.strategies.values())).flatten(1, 2)  # (S, b·p, V)
        if reference.scored is not None:
            stacked = stacked[:, reference.scored.flatten()]  # the mixture reads the scored positions only
        groups = token_groups(stacked)
        # kept as NumPy and wrapped again at each snapshot: host memory, whatever device the model is on
        self.host = {name: q.numpy() for name, q in reference.strategies.items()}
        self.host_logs = {name: safe_log(q).numpy() for name, q in reference.strategies.items()}  # read every snapshot
        self.host_truth = None if reference.truth is None else reference.truth.numpy()
        self.host_truth_log = None if reference.truth is None else safe_log(reference.truth).numpy()
        self.host_scored = None if reference.scored is None else reference.scored.numpy()
        self.host_groups = (groups.group.numpy(), groups.profile.numpy())
        self.lines = strategy_lines(reference)
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.reference.strategies) if self.reference is not None else ()

    story = summary = (f"{PREFIX}kl/", f"{PREFIX}closest", f"{PREFIX}weight/")  # "/": every strategy's key

    def applies(self, model) -> bool:
        return self.reference is not None

    def measure(self, run: ProbeRun) -> StrategyReading:
        reference = self.reference
        device = run.logits.device
        logits = run.model(reference.tokens.to(device))[
            :, reference.positions.to(device)
        ]  # (b, p, V): interventions on
        logits = logits.cpu().double()  # small: [b, p, V]; the KLs and the mixture in float64 on the host
        log_probs = (logits - logits.logsumexp(-1, keepdim=True))[..., : self.n_random]
        strategies = {name: torch.from_numpy(q) for name, q in self.host.items()}
        scored = None if self.host_scored is None else torch.from_numpy(self.host_scored)
        logs = {name: torch.from_numpy(log) for name, log in self.host_logs.items()}
        kl = {name: value.numpy() for name, value in strategy_kls(strategies, log_probs, scored, logs).items()}
        truth_kl = None
        if self.host_truth is not None:
            truth, log_truth = torch.from_numpy(self.host_truth), torch.from_numpy(self.host_truth_log)
            truth_kl = scored_mean(kl_rows(truth, log_truth, log_probs), scored).numpy()
        on_tokens = log_probs.exp()
        on_tokens = (on_tokens / on_tokens.sum(-1, keepdim=True)).flatten(0, 1)  # the model given a task token
        if scored is not None:
            on_tokens = on_tokens[scored.flatten()]
        groups = TokenGroups(*(torch.from_numpy(part) for part in self.host_groups))
        weights, mixture_kl = mixture_weights(on_tokens, groups)
        return StrategyReading(self.names, kl, truth_kl, weights, mixture_kl)

    def outputs(self, result: StrategyReading, run: ProbeRun) -> list[Output]:
        outputs: list[Output] = []
        per_sequence = dict(result.kl) if result.truth_kl is None else {**result.kl, "truth": result.truth_kl}
        for name, values in per_sequence.items():
            outputs.append(Scalar(f"{PREFIX}kl/{name}", float(values.mean())))
            outputs.append(Stored(f"{PREFIX}{PER_SEQUENCE}{name}", values.astype(np.float32)))
        outputs += [Scalar(f"{PREFIX}line/{name}", value) for name, value in self.lines.items()]
        outputs.append(Scalar(f"{PREFIX}closest", float(result.closest)))
        outputs += [Scalar(f"{PREFIX}weight/{name}", float(w)) for name, w in zip(result.names, result.weights)]
        outputs.append(Scalar(f"{PREFIX}mixture_kl", result.mixture_kl))
        return outputs


def strategy_lines(reference: ReferencePredictions) -> dict[str, float]:
    """KL(truth ‖ strategy) for each strategy, mean over the scored positions (empty without a truth)."""
    truth = reference.truth
    if truth is None:
        return {}
    log_truth = truth.clamp_min(1e-300).log()
    lines = {name: kl_rows(truth, log_truth, q.clamp_min(1e-300).log()) for name, q in reference.strategies.items()}
    if reference.scored is None:
        return {name: kl.mean().item() for name, kl in lines.items()}
    return {name: kl[reference.scored].mean().item() for name, kl in lines.items()}
