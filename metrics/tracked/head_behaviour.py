"""What every head does: its score on every registered behaviour (:mod:`metrics.heads.behaviours`), one key
family a behaviour, ``heads/KEY/LxHy`` and ``heads/KEY/top``.

- :class:`HeadBehaviour` (``behaviour``), at every snapshot: where each head attends on the probe
  (:mod:`metrics.heads.behaviour`: previous-token, current-token, first-token, duplicate-token, the task's
  prefix matching and any behaviour another module adds), each against the null of random attention on
  the same tokens, and the head's type (the behaviour that clears its null by the widest margin, else
  unspecialised);
- :class:`WriteBehaviours` (``writes``), every ``tracker.writes.every_n_steps``: what each head writes
  (:mod:`metrics.heads.writes`: Olsson et al.'s copying evaluator, the OV circuit's copying score, the
  successor score and any behaviour another module adds), against the null of randomly initialised
  models' heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.heads.behaviour import (
    Null,
    applicable_behaviours,
    behaviour_targets,
    cached_random_null,
    head_types,
    per_sequence_scores,
    type_names_of,
)
from metrics.heads.behaviours.base import HeadWrites, behaviour_kinds, behaviours_reading
from metrics.heads.writes import cached_random_model_null, write_scores
from metrics.tracked.base import Every, Output, PerHead, ProbeRun, Scalar, Stored, TrackedQuantity

HEADS = "heads/"  # every behaviour's scores: heads/KEY/LxHy, heads/KEY/top (W&B's 4_heads section)
PREFIX = "heads/behaviour/"  # the attention side's types and stored readings, under heads/
TYPE_KEY = f"{PREFIX}type"  # TYPE_KEY/LxHy: the head's type code: 0 unspecialised, i + 1 the i-th behaviour scored
SCORES = f"{PREFIX}scores"  # [L, H, behaviours] per snapshot in the tensor store (NaN: nowhere defined; labelled)
PER_SEQUENCE = f"{PREFIX}per_sequence"  # [L, b, H, behaviours] per snapshot in the tensor store
MAX_TYPE_KEYS = 32  # a key per head's type while the model has at most this many heads (the store keeps all)
NULL_MEAN, NULL_STD = f"{PREFIX}null_mean", f"{PREFIX}null_std"  # [behaviours] per snapshot in the store


@dataclass(frozen=True)
class BehaviourReading:
    """One snapshot's reading: ``scores [L, H, behaviours]`` (NaN where a behaviour is nowhere defined),
    ``per_sequence [L, b, H, behaviours]``, ``types [L, H]`` (codes into ``type_names_of(names)``), the
    behaviours read (in ``names`` order), the null they were typed against and ``names``, every
    behaviour scored (the scores' last axis)."""

    scores: Tensor
    per_sequence: Tensor
    types: Tensor
    behaviours: tuple[str, ...]
    null: Null
    names: tuple[str, ...]

    def score(self, name: str) -> Tensor:
        """Every head's score on behaviour ``name``, ``[L, H]`` (NaN where it is nowhere defined)."""
        return self.scores[..., self.names.index(name)]


class HeadBehaviour(TrackedQuantity):
    """``heads/KEY/LxHy`` and ``heads/KEY/top`` for each attention-side behaviour that applies to the
    probe's tokens, ``heads/behaviour/type/LxHy`` (each head's type code: 0 unspecialised, then the scored
    behaviours' index + 1; up to :data:`MAX_TYPE_KEYS` heads), ``heads/behaviour/count/TYPE`` (heads of each
    type it can have), and in the tensor store the scores, the types, the per-sequence scores and the null,
    from which the end-of-run report dates every head's type switches with bootstrap intervals. Prefix
    matching is read under the task's own name for it (``Task.reader_behaviour``: ``induction`` on repeated
    tokens, ``statistical_induction`` on chains). Read with the run's interventions on, from the probe pass
    the other scores read."""

    name = "behaviour"
    story = ("heads/prev_token/top", "heads/induction/top", "heads/statistical_induction/top")
    summary = story
    phase_changes = {"induction": ("heads/induction/top", False)}

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.prefix_matching = "induction"
        self.task: str | None = None  # a behaviour that names its tasks is read on those only
        self.bos_id: int | None = None
        self.prepared: tuple | None = None  # (tokens, targets, behaviours, null, weights): the probe's, once

    def for_task(self, task, n_random: int) -> HeadBehaviour:
        self.prefix_matching, self.task = task.reader_behaviour, task.name
        self.bos_id = n_random if task.bos else None
        return self

    def prepare(self, probe, model) -> None:
        """The probe's targets and null before the first snapshot (200 random heads: a one-time cost)."""
        self.targets_of(probe.tokens.cpu(), model.W_E.device)

    def targets_of(self, tokens: Tensor, device: torch.device):
        """The probe's target masks, applicable behaviours, random-attention null and the masks' weights
        in float32 on ``device``, made at the first snapshot and kept (the probe is the same at every
        snapshot). Only the behaviours read on this run's task are scored and stored (one that names other
        tasks is left out of the stored axis too)."""
        if self.prepared is None or not torch.equal(self.prepared[0], tokens) or self.prepared[4].device != device:
            names = list(behaviours_reading("attention", self.task))
            targets = behaviour_targets(tokens, self.bos_id, names)
            behaviours = applicable_behaviours(targets, self.prefix_matching, task=self.task)
            weights = targets.weights(torch.float32, device)
            null = cached_random_null(targets)
            self.prepared = (tokens, targets, behaviours, (null.mean.numpy(), null.std.numpy()), weights)
        tokens, targets, behaviours, (mean, std), weights = self.prepared
        # the null kept as NumPy and wrapped again at each snapshot: host memory, whatever device the model is on
        return targets, behaviours, Null(torch.from_numpy(mean), torch.from_numpy(std)), weights

    def measure(self, run: ProbeRun) -> BehaviourReading:
        patterns = run.patterns.detach().float()  # (L, b, H, t, t), where the model is: one small copy back
        targets, behaviours, null, weights = self.targets_of(run.tokens.cpu(), patterns.device)
        per_sequence = per_sequence_scores(patterns, targets, weights).cpu().double()  # (L, b, H, behaviours)
        scores = per_sequence.nanmean(dim=1)  # (L, H, behaviours)
        names = targets.names
        types = head_types(scores, null, behaviours, names=names)
        return BehaviourReading(scores, per_sequence, types, behaviours, null, names)

    def outputs(self, result: BehaviourReading, run: ProbeRun) -> list[Output]:
        names, kinds = result.names, behaviour_kinds()
        outputs: list[Output] = [
            PerHead(HEADS + kinds[name].key_name(), result.score(name)) for name in result.behaviours
        ]
        outputs.append(Stored(SCORES, result.scores.float().numpy(), names))
        L, H = result.types.shape
        if L * H <= MAX_TYPE_KEYS:
            outputs += [Scalar(f"{TYPE_KEY}/L{l}H{h}", float(result.types[l, h])) for l in range(L) for h in range(H)]
        outputs.append(Stored(TYPE_KEY, result.types.numpy().astype("float32")))
        types = type_names_of(names)
        counts = torch.bincount(result.types.flatten(), minlength=len(types))
        read = (types[0], *result.behaviours)  # unspecialised and the behaviours read: the types a head can have
        outputs += [Scalar(f"{PREFIX}count/{kind}", float(counts[types.index(kind)])) for kind in read]
        outputs.append(Stored(PER_SEQUENCE, result.per_sequence.float().numpy(), names))
        outputs.append(Stored(NULL_MEAN, result.null.mean.float().numpy(), names))
        outputs.append(Stored(NULL_STD, result.null.std.float().numpy(), names))
        return outputs


WRITE_SCORES = f"{HEADS}writes/scores"  # [L, H, behaviours] per snapshot in the tensor store (labelled)
WRITE_NULL_MEAN, WRITE_NULL_STD = f"{HEADS}writes/null_mean", f"{HEADS}writes/null_std"  # [behaviours]


@dataclass(frozen=True)
class WriteReading:
    """One snapshot's write-side reading: ``scores [L, H, behaviours]`` over ``names``, and their ``null``."""

    scores: Tensor
    names: tuple[str, ...]
    null: Null

    def score(self, name: str) -> Tensor:
        """Every head's score on behaviour ``name``, ``[L, H]``."""
        return self.scores[..., self.names.index(name)]


class WriteBehaviours(TrackedQuantity):
    """``heads/KEY/LxHy`` and ``heads/KEY/top`` for each write-side behaviour read on the run's task (the
    copying evaluator ``heads/copying``, the OV circuit's ``heads/ov_copying``, ``heads/successor``, ...),
    every ``every_n_steps``; in the tensor store the scores and their null (randomly initialised models'
    heads on the same probe, :func:`metrics.heads.writes.random_model_null`, made once a run before the
    first snapshot: :meth:`prepare`)."""

    name, label = "writes", "what heads write"
    Options = Every
    reads_head_writes = True

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self.task: str | None = None
        self.n_random = 0
        self.null: tuple | None = None  # (shape, tokens, Null): the probe's, once

    def for_task(self, task, n_random: int) -> WriteBehaviours:
        self.task, self.n_random = task.name, n_random
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(behaviours_reading("writes", self.task))

    def prepare(self, probe, model) -> None:
        """The null before the first snapshot (200 random heads, or the disk cache's): a one-time cost."""
        self.null_of(model, probe)

    def n_random_of(self, model, probe) -> int:
        """The task's own token ids; without a task (a one-off snapshot), every id but a BOS."""
        return self.n_random or model.shape.d_vocab - probe.first_start

    def null_of(self, model, probe) -> Null:
        """The write-side null of ``model``'s shape on ``probe`` (made once a run, kept in the disk cache)."""
        tokens = probe.tokens.cpu()
        if self.null is None or self.null[0] != model.shape or not torch.equal(self.null[1], tokens):
            null = cached_random_model_null(
                model.shape, tokens, probe.first_start, self.n_random_of(model, probe), self.names
            )
            self.null = (model.shape, tokens, null)
        return self.null[2]

    def measure(self, run: ProbeRun) -> WriteReading:
        model, probe = run.model, run.probe
        writes = HeadWrites(
            model,
            run.tokens,
            run.patterns,
            torch.stack(run.cache["head_out"]),
            probe.first_start,
            self.n_random_of(model, probe),
            run.circuits,
        )
        names = self.names
        return WriteReading(write_scores(writes, names), names, self.null_of(model, probe))

    def outputs(self, result: WriteReading, run: ProbeRun) -> list[Output]:
        kinds = behaviour_kinds()
        outputs: list[Output] = [PerHead(HEADS + kinds[name].key_name(), result.score(name)) for name in result.names]
        outputs.append(Stored(WRITE_SCORES, result.scores.float().numpy(), result.names))
        outputs.append(Stored(WRITE_NULL_MEAN, result.null.mean.float().numpy(), result.names))
        outputs.append(Stored(WRITE_NULL_STD, result.null.std.float().numpy(), result.names))
        return outputs
