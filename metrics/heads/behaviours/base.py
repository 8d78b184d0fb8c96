"""A head behaviour: the keys a head doing it attends to from each query, read from a token batch
(:mod:`metrics.heads.behaviour` scores every head on it, with its null, and types heads by it).

A behaviour is a subclass of :class:`Behaviour` with a ``name`` and :meth:`Behaviour.targets`; one
module each in ``metrics/heads/behaviours/``, or in an installed package's module named under the
``induction_composition_tracker`` entry points (:mod:`registry.extensions`). Subclassing is registering:
:func:`behaviour_kinds` lists them, the built-in ones first in the order runs have always stored them.
A behaviour that only makes sense on some tasks names them (``tasks``); it is read on those runs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import ClassVar

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


class Behaviour:
    """One behaviour: ``name`` (its key: ``heads/behaviour/NAME/top``, a head's type), ``colour`` (its
    colour in figures), ``tasks`` (the tasks it is read on; empty: every task)."""

    name: ClassVar[str] = ""
    colour: ClassVar[str] = "tab:gray"
    tasks: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def targets(relations: TokenRelations) -> Tensor:
        """``[b, query, key]`` (bool): the keys a head doing this attends to from each query; a query
        with none is not scored on it."""
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
