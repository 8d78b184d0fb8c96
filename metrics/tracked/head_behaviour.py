"""What every head does at each snapshot: its behaviour scores on the probe (:mod:`metrics.heads.behaviour`:
previous-token, current-token, first-token, duplicate-token, the task's prefix matching and any
behaviour another module adds, :mod:`metrics.heads.behaviours`), each against the null of random
attention on the same tokens, and the head's type (the behaviour that clears its null by the widest
margin, else unspecialised)."""

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
from metrics.heads.behaviours.base import behaviour_kinds
from metrics.tracked.base import Output, ProbeRun, Scalar, Stored, TrackedQuantity

PREFIX = "heads/behaviour/"  # under heads/: W&B's 4_heads section (records/wandb_sections.py)
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


class HeadBehaviour(TrackedQuantity):
    """``heads/behaviour/NAME/top`` (the best head's score) for each behaviour that applies to the
    probe's tokens (every head's in the tensor store), ``heads/behaviour/type/LxHy`` (each head's type
    code: 0 unspecialised, then the scored behaviours' index + 1; up to
    :data:`MAX_TYPE_KEYS` heads), ``heads/behaviour/count/TYPE`` (heads of each type it can have), and
    in the tensor store the types, the per-sequence scores and the null, from which the end-of-run
    report dates every head's type switches with bootstrap intervals. Prefix matching is read under the
    task's own name for it (``Task.reader_behaviour``: ``induction`` on repeated tokens,
    ``statistical_induction`` on chains). Read with the run's interventions on, from the probe pass the
    other scores read."""

    name = "behaviour"

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

    def prepare(self, probe, device: torch.device) -> None:
        """The probe's targets and null before the first snapshot (200 random heads: a one-time cost)."""
        self.targets_of(probe.tokens.cpu(), device)

    def targets_of(self, tokens: Tensor, device: torch.device):
        """The probe's target masks, applicable behaviours, random-attention null and the masks' weights
        in float32 on ``device``, made at the first snapshot and kept (the probe is the same at every
        snapshot). Only the behaviours read on this run's task are scored and stored (one that names other
        tasks is left out of the stored axis too)."""
        if self.prepared is None or not torch.equal(self.prepared[0], tokens) or self.prepared[4].device != device:
            kinds = behaviour_kinds()
            names = [name for name, kind in kinds.items() if not kind.tasks or self.task in kind.tasks]
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
        names = result.names
        outputs: list[Output] = [
            Scalar(f"{PREFIX}{name}/top", float(result.scores[..., names.index(name)].max()))
            for name in result.behaviours
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
