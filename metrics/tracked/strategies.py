"""Which strategy the model is using (:mod:`metrics.dynamics.strategy_readings`), on fresh held-out sequences
of the run's task: its KL to each of the task's reference predictors (:meth:`data.task.Task.reference`),
its KL to the truth where the task knows it, the closest strategy and the mixture reading."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.reference_predictors import HELD_OUT_STRATEGY_IDS, ReferencePredictions
from metrics.dynamics.strategy_readings import (
    TokenGroups,
    grouped_kls,
    kl_rows,
    load_solver,
    mixture_weights,
    negative_entropies,
    token_groups,
)
from metrics.tracked.base import Output, ProbeRun, Scalar, Stored, TrackedQuantity

PREFIX = "strategies/"
PER_SEQUENCE = "per_sequence/"  # strategies/per_sequence/NAME in the tensor store: [b] per snapshot


@dataclass
class StrategiesOptions:
    """``tracker.strategies.*``: every ``every_n_steps`` steps (0: off), on ``sequences`` held-out
    sequences of the task (drawn once, the same at every snapshot)."""

    every_n_steps: int = 20  # a switch's step to 20 steps (docs/configuration.md)
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
        """Draw the held-out sequences of ``task`` and its strategies on them (once), and load the
        mixture's solver (:func:`~metrics.dynamics.strategy_readings.load_solver`)."""
        if self.enabled:
            load_solver()
            ids = np.arange(HELD_OUT_STRATEGY_IDS, HELD_OUT_STRATEGY_IDS + self.options.sequences)
            self.use(task.reference(ids, n_random), n_random)
        return self

    def use(self, reference: ReferencePredictions, n_random: int) -> Strategies:
        """Score on ``reference`` (held-out sequences and their strategies) instead. What every snapshot
        reads is prepared here, on the host (whatever device the model is on): the scored positions'
        token groups under the strategies and the truth (:class:`TokenGroups`), their negative entropies,
        and each scored position's sequence."""
        self.reference, self.n_random = reference, n_random
        columns = [*reference.strategies.values(), *([] if reference.truth is None else [reference.truth])]
        stacked = torch.stack(columns).flatten(1, 2)  # (S [+ truth], b·p, V)
        b, p = reference.tokens.shape[0], len(reference.positions)
        scored = torch.ones(b, p, dtype=torch.bool, device="cpu") if reference.scored is None else reference.scored
        stacked = stacked[:, scored.flatten()]  # (S [+ truth], N, V): the scored positions only
        groups = token_groups(stacked)
        rows = scored.flatten().nonzero().squeeze(1)  # (N,) into the flattened (b·p) positions
        # kept as NumPy and wrapped again at each snapshot: host memory, whatever device the model is on
        self.host = {
            "group": groups.group.numpy(),  # (N, V)
            "profile": groups.profile.numpy(),  # (N, G, S [+ truth])
            "negative_entropy": negative_entropies(stacked).numpy(),  # (N, S [+ truth])
            "rows": rows.numpy(),
            "row_sequence": (rows // p).numpy(),  # (N,): each scored position's sequence
            "rows_per_sequence": scored.sum(-1, keepdim=True).double().numpy(),  # (b, 1)
        }
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
        host = {name: torch.from_numpy(array) for name, array in self.host.items()}
        groups = TokenGroups(host["group"], host["profile"])
        log_probs = log_probs.flatten(0, 1)[host["rows"]]  # (N, n_random): the scored positions
        kls = grouped_kls(groups, host["negative_entropy"], log_probs)  # (N, S [+ truth])
        b = reference.tokens.shape[0]
        per_sequence = torch.zeros(b, kls.shape[1], dtype=torch.float64, device="cpu")
        per_sequence = (per_sequence.index_add_(0, host["row_sequence"], kls) / host["rows_per_sequence"]).numpy()
        names = self.names
        kl = {name: per_sequence[:, i] for i, name in enumerate(names)}
        truth_kl = per_sequence[:, len(names)] if reference.truth is not None else None
        on_tokens = log_probs - log_probs.logsumexp(-1, keepdim=True)  # the model given a task token
        weights, mixture_kl = mixture_weights(on_tokens.exp(), groups.first(len(names)), log_model=on_tokens)
        return StrategyReading(names, kl, truth_kl, weights, mixture_kl)

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
