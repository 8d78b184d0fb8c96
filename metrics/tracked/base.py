"""A tracked quantity: one class that says what it measures from one probe pass, when, with which
options, and what it gives the records.

A subclass of :class:`TrackedQuantity` (in a module of ``metrics/tracked/``, or of an extension,
:mod:`registry.extensions`) is registered by being defined. It declares

- ``name``: the key of its result in a snapshot (``snapshot[name]``) and of its options in the config
  (``tracker.NAME.OPTION``);
- ``Options``: a dataclass of its options, each default written there once (the config schema is
  built from it); with an ``every_n_steps`` field the quantity runs on that schedule (0: never),
  without one at every snapshot; ``problems()`` on it says what is wrong with its values;
- ``after``: the quantities whose results it reads (they run first at the same snapshot);
  ``runs_with``: quantities whose steps it also runs at (the matching score with the ablation);
- :meth:`measure`: its result, from the probe pass (:class:`ProbeRun`: the model, the probe, the
  cached forward pass, the results of the quantities it runs after);
- :meth:`outputs`: what the records write of a result, as typed values (:class:`Scalar`,
  :class:`PerHead`, :class:`PerPair`, :class:`Stored`, :class:`Heatmap`) that ``records/keys.py``
  turns into W&B keys and CSV columns and ``records/tensor_store.py`` into stored tensors; ``story``
  (the W&B section told first), ``summary`` (their last value in ``summary.json``) and
  ``phase_changes`` name some of those keys (an entry of ``story`` or ``summary`` ending in ``/`` names
  every key under it);
- :meth:`for_task`: what it needs of the run's task (the strategies draw the task's held-out
  sequences and reference predictors); most quantities need nothing.

Metrics stay pure: a quantity never logs, draws no random numbers and leaves the model as it found it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from data.probe import ProbeBatch
from metrics.composition.circuits import HeadCircuits, head_circuits
from metrics.composition.engine import DEFAULT_CHUNK_BYTES
from metrics.dynamics.loss_views import token_losses

Head = tuple[int, int]  # (layer, head)


# --- what the records get ---------------------------------------------------------------------


@dataclass(frozen=True)
class Scalar:
    """One number under the key ``name`` (W&B and the CSV; not stored as a tensor)."""

    name: str
    value: float


@dataclass(frozen=True)
class PerHead:
    """A score of every head, ``values [n_layers, n_heads]``: keys ``NAME/L0H1`` (while the model has
    few heads) and ``NAME/top``; stored whole under ``NAME``."""

    name: str
    values: Any


@dataclass(frozen=True)
class PerPair:
    """A value of every earlier->later head pair, ``values [L, H, L, H]`` (NaN where the reader is not
    later): keys ``NAME/L0H1->L1H3`` on small models, else ``NAME/{max,mean}`` and, with ``top``, the
    best pairs under ``TOP/{i}``; with ``circuit``, the circuit pair's value under ``circuit/CIRCUIT``;
    stored under ``NAME`` unless ``store`` is False."""

    name: str
    values: Any
    circuit: str | None = None
    top: str | None = None
    store: bool = True


@dataclass(frozen=True)
class Stored:
    """An array kept in the tensor store only, under ``name``; ``labels`` name its last axis' entries
    (kept in the store's index: :func:`records.tensor_store.tensor_labels`)."""

    name: str
    values: Any
    labels: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Heatmap:
    """A figure of ``{kind: [L, H, L, H]}`` (rows writers, columns readers), W&B only, under ``images/NAME``."""

    name: str
    by_kind: dict
    caption: str


Output = Scalar | PerHead | PerPair | Stored | Heatmap


# --- options ------------------------------------------------------------------------------------


@dataclass
class Every:
    """The options of a quantity that runs on its own schedule: every this many steps (a multiple of
    ``tracker.every_n_steps``), at step 0 and at the last step; 0 turns it off."""

    every_n_steps: int = 100

    def problems(self) -> list[str]:
        """What is wrong with these values beyond their types, one sentence each naming the option
        (without its ``tracker.NAME.`` prefix, which the caller adds)."""
        return [] if self.every_n_steps >= 0 else [f"every_n_steps={self.every_n_steps} must be >= 0 (0 turns it off)"]


# --- what a quantity reads ------------------------------------------------------------------------


class ProbeRun:
    """One snapshot's probe pass and what the quantities derive from it, computed once, when first read.

    ``logits [b, t, V]`` and ``cache`` (:meth:`~models.transformer.AttentionOnlyTransformer.run_with_cache`)
    of the model in eval mode on ``probe``; ``dtype``: the precision of the weight-based measures
    (None: the model's, at least float32); ``due``: the names of the quantities measured at ``step``
    (``last``: the run's last step); ``results``: theirs, by name, as they are made."""

    def __init__(
        self,
        model,
        probe: ProbeBatch,
        logits: Tensor,
        cache: dict,
        due: frozenset[str],
        dtype: torch.dtype | None = None,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        step: int = 0,
        last: bool = True,
    ) -> None:
        self.model, self.probe, self.logits, self.cache = model, probe, logits, cache
        self.due, self.dtype, self.max_chunk_bytes, self.step, self.last = due, dtype, max_chunk_bytes, step, last
        self.tokens = probe.tokens.to(logits.device)
        self.results: dict[str, Any] = {}

    @cached_property
    def patterns(self) -> Tensor:
        """Every layer's attention ``[L, b, H, t, t]``."""
        return torch.stack(self.cache["pattern"])

    @cached_property
    def token_losses(self) -> Tensor:
        """``[b, t - 1]``: entry j is the loss of predicting token j + 1."""
        return token_losses(self.logits.float(), self.tokens)

    @cached_property
    def circuits(self) -> HeadCircuits:
        """The weights' low-rank QK and OV circuits (:func:`~metrics.composition.circuits.head_circuits`)."""
        return head_circuits(self.model, self.dtype)

    @property
    def circuit(self) -> tuple[Head, Head] | None:
        """The circuit pair of this snapshot (the ``circuit`` quantity's result), if there is one."""
        return self.results.get("circuit")


# --- the protocol -------------------------------------------------------------------------------


class TrackedQuantity:
    """See the module docstring. ``options``: an instance of ``Options`` (None: its defaults)."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""  # what the cost report calls it (default: its name)
    Options: ClassVar[type | None] = None
    after: ClassVar[tuple[str, ...]] = ()
    runs_with: ClassVar[tuple[str, ...]] = ()
    reads_head_writes: ClassVar[bool] = False  # the probe pass must keep every head's write (cache["head_out"])
    rescored_every_step: ClassVar[bool] = True  # False: a re-scoring of saved weights keeps its period (heatmaps)
    story: ClassVar[tuple[str, ...]] = ()
    summary: ClassVar[tuple[str, ...]] = ()
    phase_changes: ClassVar[dict[str, tuple[str, bool]]] = {}  # summary name -> (key, falling)
    pair_keys: ClassVar[int] = 0  # keys a scored pair gets in per-pair mode (which mode a run logs in)
    root_options: ClassVar[bool] = False  # its options are the tracker's own (tracker.OPTION, not tracker.NAME.OPTION)

    def __init__(self, options=None) -> None:
        self.options = options if options is not None or self.Options is None else self.Options()
        self.at_every_step = False  # a re-scoring of saved weights: due at every chosen step (while on)

    @classmethod
    def from_options(cls, options: dict):
        """The quantity from every quantity's (and measure's) options by name, as the tracker's settings hold them."""
        return cls(options.get(cls.name))

    @property
    def every_n_steps(self) -> int | None:
        """Its period in steps; None: at every snapshot."""
        return getattr(self.options, "every_n_steps", None)

    @property
    def enabled(self) -> bool:
        return self.every_n_steps != 0

    def due(self, step: int, last: bool) -> bool:
        """Whether it runs at ``step`` on its own schedule (``last``: the run's last step, where everything on runs)."""
        every = self.every_n_steps
        if self.at_every_step:
            return self.enabled
        return every is None or (every > 0 and (step % every == 0 or last))

    def for_rescoring(self) -> TrackedQuantity:
        """This quantity for a re-scoring of saved weights, where the steps are chosen: due at each one
        (while it is on), unless ``rescored_every_step`` is False (it keeps its period)."""
        self.at_every_step = self.rescored_every_step
        return self

    def applies(self, model) -> bool:
        """Whether it means anything for ``model`` at all (e.g. pairs need two layers)."""
        return True

    def for_task(self, task, n_random: int) -> TrackedQuantity:
        """This quantity for a run on ``task`` (:class:`data.task.Task`) with ``n_random`` task tokens."""
        return self

    def prepare(self, probe: ProbeBatch, model) -> None:
        """One-time work on the tracker's ``probe`` before the first snapshot of ``model`` (its shape, its
        device; left out of the cost report, as the random baselines are); nothing by default."""

    def measure(self, run: ProbeRun) -> Any:
        raise NotImplementedError

    def outputs(self, result: Any, run: ProbeRun) -> list[Output]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """What a resumed run needs to measure exactly as an uninterrupted one (kept in the checkpoint)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


BUILT_IN = "metrics.tracked"
BUILT_IN_FIRST = ("probe_views", "composition", "matching", "ground_truth")
"""The built-in modules whose quantities run first, in this order (what every snapshot reads first,
then what reads the weights' circuits); any other module of the package after them, by name."""


def tracked_quantities() -> dict[str, type[TrackedQuantity]]:
    """Every tracked quantity by name, in the order they run (each after those it reads): the
    built-in ones (every module of ``metrics/tracked/``) and the extensions' (:mod:`registry.extensions`)."""
    from registry.extensions import registered

    found = registered(TrackedQuantity, BUILT_IN, "tracked quantities", BUILT_IN_FIRST)
    return {name: found[name] for name in run_order(found)}


def with_companions(quantities: list[TrackedQuantity], names: set[str]) -> set[str]:
    """``names`` and the name of every quantity that runs with one of them (its ``runs_with``)."""
    return set(names) | {q.name for q in quantities if set(names) & set(q.runs_with)}


def registered_measures() -> dict:
    """Every composition measure by name (:data:`metrics.composition.measures.MEASURES`), once every
    module that registers one is imported (the data-aware share's, an extension's)."""
    from metrics.composition.measures import MEASURES

    tracked_quantities()
    return dict(MEASURES)


def run_order(found: dict[str, type[TrackedQuantity]]) -> list[str]:
    """The names in an order where each comes after those it reads (``after``), else as defined."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"tracked quantities read each other in a circle through {name!r}")
        visiting.add(name)
        for earlier in found[name].after:
            if earlier in found:
                visit(earlier)
        visiting.discard(name)
        order.append(name)

    for name in found:
        visit(name)
    return order


def as_numpy(values) -> np.ndarray:
    """A CPU numpy copy of a tensor (or an array as is), in its own precision if numpy has it
    (float32, float64), else float32 (numpy has no bfloat16)."""
    if not hasattr(values, "detach"):
        return np.asarray(values)
    values = values.detach()
    if values.is_floating_point() and values.element_size() < 4:  # float16, bfloat16
        values = values.float()
    return values.cpu().numpy()


__all__ = [
    "Every",
    "Head",
    "Heatmap",
    "Output",
    "PerHead",
    "PerPair",
    "ProbeRun",
    "Scalar",
    "Stored",
    "TrackedQuantity",
    "tracked_quantities",
    "with_companions",
]
