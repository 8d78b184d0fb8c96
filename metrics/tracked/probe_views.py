"""What every snapshot reads off the probe pass: the loss views, the circuit pair the heads' behaviours name
(:mod:`metrics.tracked.head_behaviour`), and (while a training-time intervention is on) the loss and the
top previous-token and induction scores without it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrics.dynamics.loss_views import first_occurrence_loss, in_context_learning_score, repeated_loss, token_losses
from metrics.heads.behaviour import behaviour_scores, behaviour_targets
from metrics.heads.circuit_pair import circuit_pair
from metrics.tracked.base import Output, ProbeRun, Scalar, TrackedQuantity

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


class CircuitPair(TrackedQuantity):
    """The circuit pair (docs/measures.md): the top previous-token head and the top head of a later
    layer at the task's reader behaviour (``Task.reader_behaviour``), ``((l1, h1), (l2, h2))``: the
    induction score on repeated tokens, the statistical-induction score on chains (both the ``behaviour``
    quantity's); what the ``circuit/`` keys of every other quantity read."""

    name = "circuit"
    after = ("behaviour",)

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.reader = "induction"

    def for_task(self, task, n_random: int) -> CircuitPair:
        self.reader = task.reader_behaviour
        return self

    def applies(self, model) -> bool:
        return model.shape.n_layers >= 2

    def measure(self, run: ProbeRun):
        behaviour = run.results["behaviour"]
        reader = behaviour.score(self.reader).nan_to_num(nan=-1.0)  # nowhere defined: no head reads
        return circuit_pair(behaviour.score("previous_token"), reader)

    def outputs(self, result, run: ProbeRun) -> list[Output]:
        (l1, h1), (l2, h2) = result
        names = ("writer_layer", "writer_head", "reader_layer", "reader_head")
        return [Scalar(f"circuit/{name}", value) for name, value in zip(names, (l1, h1, l2, h2))]


INTERVENTION_OFF = "intervention_off/"
"""Prefix of the scores measured with a run's training-time interventions off."""


class InterventionOff(TrackedQuantity):
    """While a training-time intervention is on: the repeated-token loss and the top previous-token
    and induction scores with it off (does the model still need it?), ``intervention_off/...``: the
    ``behaviour`` quantity's scores, on the patterns the model makes without its interventions."""

    name = "intervention_off"
    after = ("behaviour",)
    summary = tuple(INTERVENTION_OFF + key for key in ("loss/repeated", "heads/prev_token/top", "heads/induction/top"))

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.bos_id: int | None = None

    def for_task(self, task, n_random: int) -> InterventionOff:
        self.bos_id = n_random if task.bos else None
        return self

    def applies(self, model) -> bool:
        return model.intervened  # at the snapshots where one is on

    def measure(self, run: ProbeRun) -> dict[str, float]:
        model = run.model
        with model.changes_off():
            logits, cache = model.run_with_cache(run.tokens, head_out=False)
        patterns = torch.stack(cache["pattern"]).float()  # (L, b, h, t, t)
        losses = token_losses(logits.float(), run.tokens)
        reading = run.results["behaviour"]
        targets = behaviour_targets(run.tokens.cpu(), names=reading.names, bos_id=self.bos_id)
        scores = behaviour_scores(patterns, targets)  # (L, h, behaviours)
        found = {"loss/repeated": repeated_loss(losses, run.probe).item()}
        for name, key in (("previous_token", "heads/prev_token/top"), ("induction", "heads/induction/top")):
            if name in reading.behaviours:
                found[key] = scores[..., reading.names.index(name)].max().item()
        return found

    def outputs(self, result: dict[str, float], run: ProbeRun) -> list[Output]:
        return [Scalar(INTERVENTION_OFF + key, value) for key, value in result.items()]
