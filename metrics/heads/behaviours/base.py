"""A head behaviour: one score of every head, with its null (what the score reads where nothing is learnt).
Every per-head score of the tracker is one, read from one of two things:

- **where a head attends** (``reads = "attention"``): :meth:`Behaviour.targets`, the keys a head doing it
  attends to from each query, read from a token batch. :mod:`metrics.heads.behaviour` scores every head
  on it from the probe's attention patterns at every snapshot, against random attention's null, and
  types heads by these behaviours (previous-token, induction, ...);
- **what a head writes** (``reads = "writes"``): :meth:`Behaviour.score`, from each head's write on the
  probe and the model's weights (:class:`HeadWrites`: its OV circuit, its direct effect on the logits),
  every ``tracker.writes.every_n_steps``, against a null of randomly initialised models of the same shape
  (:func:`metrics.heads.writes.random_model_null`). What a head writes does not type it: an induction
  head that copies is an induction head.

A behaviour is a subclass of :class:`Behaviour` with a ``name``; one module each in
``metrics/heads/behaviours/``, or in an installed package's module named under the
``induction_composition_tracker`` entry points (:mod:`registry.extensions`). Subclassing is registering:
:func:`behaviour_kinds` lists them, the built-in ones first in the order runs have always stored them.
A behaviour that only makes sense on some tasks names them (``tasks``); it is read on those runs only.
Its scores are logged as ``heads/KEY/LxHy`` and ``heads/KEY/top`` (``key``: its ``name`` unless it says).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import torch
from torch import Tensor

BUILT_IN = "metrics.heads.behaviours"
BUILT_IN_FIRST = ("previous_token", "current_token", "first_token", "duplicate_token", "induction")
"""The built-in modules in the order their behaviours sit on the stored scores' last axis (that of
runs written before the axis was labelled); any other module after them, by name, then extensions'."""


@dataclass(frozen=True)
class TokenRelations:
    """What targets are read from, built once per token batch ``tokens [b, s]``: ``query [s, 1]`` and
    ``key [1, s]`` positions; ``same [b, query, key]``, ``x_q == x_k``; ``prefix [b, query, key]``,
    ``x_q == x_{k-1}`` for ``1 <= k <= q`` (the token after an earlier occurrence of the current one). With
    a BOS id, a BOS token equals nothing."""

    tokens: Tensor
    query: Tensor
    key: Tensor
    same: Tensor
    prefix: Tensor

    @classmethod
    def of(cls, tokens: Tensor, bos_id: int | None = None) -> TokenRelations:
        s = tokens.shape[1]
        query = torch.arange(s, device=tokens.device)[:, None]
        key = torch.arange(s, device=tokens.device)[None, :]
        same = tokens[:, :, None] == tokens[:, None, :]
        if bos_id is not None:
            ordinary = tokens != bos_id
            same &= ordinary[:, :, None] & ordinary[:, None, :]
        prefix = torch.zeros_like(same)
        prefix[:, :, 1:] = same[:, :, :-1]
        prefix &= (key <= query)[None]
        return cls(tokens, query, key, same, prefix)

    def positional(self, mask: Tensor) -> Tensor:
        """A ``[query, key]`` mask for every sequence: ``[b, query, key]``."""
        b, s = self.tokens.shape
        return mask.expand(b, s, s)


@dataclass(frozen=True)
class HeadWrites:
    """What a write-side behaviour reads at a snapshot: the ``model``; the probe's ``tokens [b, t]``, its
    attention ``patterns [L, b, H, t, t]`` and each head's write ``head_out [L, b, H, t, d_model]`` (without
    ``b_O``); ``first_query``, the first position scored (after BOS); ``n_random``, the task's own token ids
    ``0 .. n_random - 1`` (BOS, if any, is ``n_random``); ``circuits``, the weights' low-rank QK and OV
    circuits with the norms folded in (:func:`metrics.composition.circuits.head_circuits`, in the precision
    of the weight-based measures)."""

    model: Any
    tokens: Tensor
    patterns: Tensor
    head_out: Tensor
    first_query: int
    n_random: int
    circuits: Any


class Behaviour:
    """One behaviour: ``name`` (a head's type, for an attention-side one), ``key`` (its scores' name under
    ``heads/``; default ``name``), ``colour`` (its colour in figures), ``tasks`` (the tasks it is read on;
    empty: every task), ``reads`` (``attention``: :meth:`targets`; ``writes``: :meth:`score`)."""

    name: ClassVar[str] = ""
    key: ClassVar[str] = ""
    colour: ClassVar[str] = "tab:gray"
    tasks: ClassVar[tuple[str, ...]] = ()
    reads: ClassVar[str] = "attention"

    @classmethod
    def key_name(cls) -> str:
        """Its scores' name under ``heads/``."""
        return cls.key or cls.name

    @staticmethod
    def targets(relations: TokenRelations) -> Tensor:
        """Attention side: ``[b, query, key]`` (bool), the keys a head doing this attends to from each query;
        a query with none is not scored on it."""
        raise NotImplementedError

    @staticmethod
    def score(writes: HeadWrites) -> Tensor:
        """Write side: every head's score ``[n_layers, n_heads]`` from what it writes (:class:`HeadWrites`)."""
        raise NotImplementedError


@cache
def behaviour_kinds() -> dict[str, type[Behaviour]]:
    """Every behaviour by name: the built-in ones first, by module (:data:`BUILT_IN_FIRST`, then the
    others by name) and within a module as defined, then the extensions' as they were imported. Found
    once a process (the registries' first use loads every extension)."""
    from registry.extensions import registered

    found = registered(Behaviour, BUILT_IN, "head behaviours", ("base", *BUILT_IN_FIRST))

    def rank(item: tuple[int, tuple[str, type[Behaviour]]]) -> tuple:
        position, (_, kind) = item
        package, _, module = kind.__module__.rpartition(".")
        if package != BUILT_IN:
            return (2, "", position)
        return (0, BUILT_IN_FIRST.index(module), position) if module in BUILT_IN_FIRST else (1, module, position)

    return dict(item for _, item in sorted(enumerate(found.items()), key=rank))


def behaviours_reading(reads: str, task: str | None = None) -> dict[str, type[Behaviour]]:
    """The registered behaviours read from ``reads`` (``attention`` or ``writes``), by name, in
    :func:`behaviour_kinds` order; with ``task``, those read on it (every task's, and its own)."""
    return {
        name: kind
        for name, kind in behaviour_kinds().items()
        if kind.reads == reads and (task is None or not kind.tasks or task in kind.tasks)
    }
