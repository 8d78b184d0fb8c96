"""What every snapshot reads off the probe pass: the loss views, the attention-pattern head scores,
the circuit pair they name, and (while a training-time intervention is on) the same without it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.dynamics.loss_views import first_occurrence_loss, in_context_learning_score, repeated_loss, token_losses
from metrics.heads.attention_scores import duplicate_token_score, induction_score, previous_token_score
from metrics.heads.circuit_pair import circuit_pair
from metrics.tracked.base import Output, PerHead, ProbeRun, Scalar, TrackedQuantity

LOSS_KEYS = ("loss/first_occurrence", "loss/repeated", "loss/icl_score")


@dataclass(frozen=True)
class LossViewValues:
    """Olsson et al. 2022's loss views on the probe (nats): the first copy's tokens, the repeat's,
    and the in-context-learning score (late minus early loss)."""

    first_occurrence: float
    repeated: float
    icl_score: float


class LossViews(TrackedQuantity):
    """``loss/first_occurrence``, ``loss/repeated``, ``loss/icl_score`` (:mod:`metrics.dynamics.loss_views`)."""

    name = "loss_views"
    story = LOSS_KEYS
    summary = ("loss/repeated", "loss/first_occurrence")
    phase_changes = {"loss": ("loss/repeated", True)}

    def measure(self, run: ProbeRun) -> LossViewValues:
        losses = run.token_losses
        return LossViewValues(
            first_occurrence_loss(losses, run.probe).item(),
            repeated_loss(losses, run.probe).item(),
            in_context_learning_score(losses).item(),
        )

    def outputs(self, result: LossViewValues, run: ProbeRun) -> list[Output]:
        values = (result.first_occurrence, result.repeated, result.icl_score)
        return [Scalar(key, value) for key, value in zip(LOSS_KEYS, values)]


class HeadScore(TrackedQuantity):
    """A score of every head from the probe pass, ``[n_layers, n_heads]``, logged as ``heads/KEY``:
    subclass it with :meth:`score` (and ``key``, the name under ``heads/``, if it is not ``name``)."""

    key: str = ""

    @property
    def prefix(self) -> str:
        return f"heads/{self.key or self.name}"

    def score(self, run: ProbeRun) -> Tensor:
        raise NotImplementedError

    def measure(self, run: ProbeRun) -> Tensor:
        return self.score(run).cpu()

    def outputs(self, result: Tensor, run: ProbeRun) -> list[Output]:
        return [PerHead(self.prefix, result)]


class PreviousToken(HeadScore):
    """Mean attention from each position to the one before it (:func:`~metrics.heads.attention_scores.previous_token_score`)."""

    name, key = "previous_token", "prev_token"
    story = summary = ("heads/prev_token/top",)

    def score(self, run: ProbeRun) -> Tensor:
        return previous_token_score(run.patterns)


class Induction(HeadScore):
    """Mean attention from each repeated token to the token after its first occurrence (:func:`~metrics.heads.attention_scores.induction_score`)."""

    name = "induction"
    story = summary = ("heads/induction/top",)
    phase_changes = {"induction": ("heads/induction/top", False)}

    def score(self, run: ProbeRun) -> Tensor:
        return induction_score(run.patterns, run.probe)


class DuplicateToken(HeadScore):
    """Mean attention from each repeated token to its first occurrence (:func:`~metrics.heads.attention_scores.duplicate_token_score`)."""

    name, key = "duplicate_token", "duplicate"

    def score(self, run: ProbeRun) -> Tensor:
        return duplicate_token_score(run.patterns, run.probe)


class CircuitPair(TrackedQuantity):
    """The circuit pair (docs/measures.md): the top previous-token head and the top head of a later
    layer at the task's reader behaviour (``Task.reader_behaviour``), ``((l1, h1), (l2, h2))``: the
    induction score on repeated tokens, the statistical-induction score (the ``behaviour`` quantity's)
    on chains; what the ``circuit/`` keys of every other quantity read."""

    name = "circuit"
    after = ("previous_token", "induction", "behaviour")

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.reader = "induction"

    def for_task(self, task, n_random: int) -> CircuitPair:
        self.reader = task.reader_behaviour
        return self

    def applies(self, model) -> bool:
        return model.shape.n_layers >= 2

    def measure(self, run: ProbeRun):
        behaviour = run.results.get("behaviour")
        if self.reader == "induction" or behaviour is None or self.reader not in behaviour.behaviours:
            return circuit_pair(run.results["previous_token"], run.results["induction"])
        reader = behaviour.scores[..., behaviour.names.index(self.reader)].nan_to_num(nan=-1.0)
        return circuit_pair(run.results["previous_token"], reader)

    def outputs(self, result, run: ProbeRun) -> list[Output]:
        (l1, h1), (l2, h2) = result
        names = ("writer_layer", "writer_head", "reader_layer", "reader_head")
        return [Scalar(f"circuit/{name}", value) for name, value in zip(names, (l1, h1, l2, h2))]


INTERVENTION_OFF = "intervention_off/"
"""Prefix of the scores measured with a run's training-time interventions off."""


class InterventionOff(TrackedQuantity):
    """While a training-time intervention is on: the repeated-token loss and the top previous-token
    and induction scores with it off (does the model still need it?), ``intervention_off/...``."""

    name = "intervention_off"
    summary = tuple(INTERVENTION_OFF + key for key in ("loss/repeated", "heads/prev_token/top", "heads/induction/top"))

    def applies(self, model) -> bool:
        return model.intervened  # at the snapshots where one is on

    def measure(self, run: ProbeRun) -> dict[str, float]:
        model = run.model
        with model.changes_off():
            logits, cache = model.run_with_cache(run.tokens, head_out=False)
        patterns = torch.stack(cache["pattern"])  # (L, b, h, t, t)
        losses = token_losses(logits.float(), run.tokens)
        return {
            "loss/repeated": repeated_loss(losses, run.probe).item(),
            "heads/prev_token/top": previous_token_score(patterns).max().item(),
            "heads/induction/top": induction_score(patterns, run.probe).max().item(),
        }

    def outputs(self, result: dict[str, float], run: ProbeRun) -> list[Output]:
        return [Scalar(INTERVENTION_OFF + key, value) for key, value in result.items()]
