"""A task: what a run trains on. One module each in ``data/tasks/`` (found there by name), or in any
installed package that names its module under the ``induction_composition_tracker`` entry points.

A task is a dataclass subclass of :class:`Task`. Its fields are its options, each default written
there once (the config learns them: ``data=NAME`` chooses the task, ``data.OPTION=VALUE`` sets one,
an unknown option is refused before anything runs); :meth:`Task.problems` says what is wrong with
its values, every problem at once; :meth:`Task.sampler` is its generator, a pure function of the
seed and the sample ids (so a stream resumes exactly and DDP ranks draw disjoint samples);
:meth:`Task.probe` is the batch the tracker's head scores, loss views and ablation read (repeated
random tokens, unless the task defines its own); :meth:`Task.reference` names the strategies (the
reference predictors, :mod:`data.reference_predictors`) the ``strategies`` quantity compares the model with, and
the true next-token distribution where the task knows it. Subclassing is registering: :func:`tasks` lists
every subclass by its ``name``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from data import reference_predictors
from data.probe import ProbeBatch, make_probe_batch
from registry.extensions import registered

TokenSampler = Callable[[np.ndarray], Tensor]
"""Sample ids ``(b,)`` -> token ids ``[b, seq_len]``."""


@dataclass
class Task:
    """The options every task has. Token ids ``0 .. n_random - 1`` are the task's own; with ``bos``
    the id ``n_random`` is BOS (``n_random`` is the model's ``d_vocab`` less one for BOS)."""

    reader_behaviour: ClassVar[str] = "induction"
    """The prefix-matching behaviour its probe shows (:mod:`metrics.heads.behaviour`): ``induction`` on
    repeated tokens, ``statistical_induction`` where earlier occurrences are a chain's in-context
    counts. The circuit pair's reader is the head that does it most."""

    name: str = ""  # the task's name (``data=NAME``): set by each task
    seed: int = 0  # the config makes it follow the run's ``seed`` unless set on its own (data.seed=S)
    batch_size: int = 32
    seq_len: int = 33
    bos: bool = True

    def problems(self, n_random: int, n_ctx: int) -> list[str]:
        """Every problem of these options for a model with ``n_random`` task tokens and ``n_ctx``
        positions, one sentence each naming its keys (empty when the task can run)."""
        problems = []
        if self.batch_size < 1:
            problems.append(f"data.batch_size={self.batch_size} must be >= 1")
        if self.seq_len < 2:
            problems.append(f"data.seq_len={self.seq_len} must be >= 2 (a token and the next one to predict)")
        if self.seq_len > n_ctx:
            problems.append(f"data.seq_len={self.seq_len} exceeds model.n_ctx={n_ctx}")
        return problems

    def strategy_problems(self, sample_ids: np.ndarray, n_random: int) -> list[str]:
        """What keeps the tracked strategies (:meth:`reference`) from being scored on the held-out
        ``sample_ids``, one sentence each: checked before a run that tracks them starts (none by
        default: a task whose held-out rows may hold nothing to score says so)."""
        return []

    def sampler(self, n_random: int) -> TokenSampler:
        """The generator: sample ids ``(b,)`` -> tokens ``[b, seq_len]``, each sample a pure function of
        ``(seed, id)`` (a packed task: of ``(seed, the batch's first id, batch size)``)."""
        raise NotImplementedError(f"task {self.name!r} defines no sampler")

    def probe_block(self) -> int:
        """The probe's block length where ``tracker.probe_n`` is not set: half the context, ``(seq_len −
        BOS) // 2``, so that the probe is as long as the training sequences."""
        return max((self.seq_len - int(self.bos)) // 2, 2)

    def probe(self, seed: int, batch_size: int, n: int, n_random: int) -> ProbeBatch:
        """The tracker's probe: ``[BOS], t_1 .. t_n, t_1 .. t_n`` random tokens (:func:`data.probe.make_probe_batch`)."""
        return make_probe_batch(seed, batch_size, n, n_random, self.bos)

    def reference(self, sample_ids: np.ndarray, n_random: int) -> reference_predictors.ReferencePredictions:
        """The task's sequences ``sample_ids`` and its strategies on them (:mod:`data.reference_predictors`), simplest
        first. Unless a task names its own: uniform, copy (uniform over the tokens in the context: one
        layer's strategy) and induction (the token that followed the current one's latest earlier
        occurrence), at every position that predicts a task token; no truth. Scored where most of the
        next tokens may be unpredictable, these need not show a switch to induction where the model
        learns it (:func:`names_own_strategies`)."""
        tokens = self.sampler(n_random)(sample_ids)
        positions = torch.arange(tokens.shape[1] - 1, device="cpu")
        predicted = reference_predictors.one_and_two_layer(tokens, n_random)
        return reference_predictors.ReferencePredictions(
            tokens, positions, reference_predictors.at_positions(predicted, positions)
        )


def names_own_strategies(task: type[Task]) -> bool:
    """Whether ``task`` names its own strategies (overrides :meth:`Task.reference`). A run of one
    that does not is compared with the generic strategies at every position: its timeline's lack of a
    switch to induction does not say the model learnt none (:mod:`reports.strategy_timeline`)."""
    return task.reference is not Task.reference


BUILT_IN = "data.tasks"
"""The package whose every module is a built-in task (importing them registers them)."""


def tasks() -> dict[str, type[Task]]:
    """Every task by name: the built-in ones (every module of ``data/tasks/``) and the extensions'
    (:mod:`registry.extensions`)."""
    return dict(sorted(registered(Task, BUILT_IN, "tasks").items()))
