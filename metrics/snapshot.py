"""Everything the tracker measures at one step: one probe pass, then every tracked quantity due
(:mod:`metrics.tracked`), in the order they read each other.

Computed where the model lives (its device), in its dtype (at least float32: half-precision weights
are measured on a float32 copy) unless ``dtype`` asks for float64, the exact path the tests use.
Only the small results (per head, per pair) are moved to the CPU. Each quantity is timed, so a caller
can say what a snapshot costs. The model's mode and every RNG are left as they were.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from data.probe import ProbeBatch
from metrics.composition.engine import DEFAULT_CHUNK_BYTES
from metrics.tracked.base import Output, ProbeRun, TrackedQuantity, tracked_quantities, with_companions
from models.transformer import AttentionOnlyTransformer

HALF_PRECISION = (torch.float16, torch.bfloat16)
"""Weights in these dtypes are measured on a float32 copy: a bf16 probe pass moves the scores by
~1 % (the ablation's pattern change by 1.5 % at init), which no measure should inherit."""


@dataclass(frozen=True)
class Snapshot:
    """One measurement: each tracked quantity's result by name (``snapshot["behaviour"].score("induction")``,
    ``[L, H]``;
    ``snapshot["composition"].scores["frobenius"]["K"]``, ``[L, H, L, H]``), the typed outputs the
    records write of them (:mod:`metrics.tracked.base`), and the seconds each part took."""

    results: dict[str, Any]
    outputs: list[Output] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.results[name]

    def __contains__(self, name: str) -> bool:
        return name in self.results

    def get(self, name: str, default: Any = None) -> Any:
        return self.results.get(name, default)

    @property
    def circuit(self):
        """The circuit pair ``((l1, h1), (l2, h2))``; None for one layer."""
        return self.results.get("circuit")


class PartTimer:
    """Wall seconds per named part; synchronises CUDA so a part's asynchronous kernels count."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@torch.inference_mode()
def measure(
    model: AttentionOnlyTransformer,
    probe: ProbeBatch,
    quantities: Iterable[TrackedQuantity],
    due: Iterable[str] | None = None,
    *,
    step: int = 0,
    last: bool = True,
    dtype: torch.dtype | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Snapshot:
    """The snapshot of ``model`` on ``probe``: the quantities named in ``due`` (None: all), in the
    order given (each after those it reads), each that applies to this model. The probe pass keeps
    the heads' writes only when a quantity due reads them."""
    quantities = [q for q in quantities if (due is None or q.name in due) and q.applies(model)]
    if model.W_E.dtype in HALF_PRECISION:  # trained in half precision: measured on a float32 copy
        model = copy.deepcopy(model).float()
    timer = PartTimer(model.W_E.device)
    was_training = model.training
    model.eval()
    try:
        tokens = probe.tokens.to(model.W_E.device)
        with timer.part("probe"):
            logits, cache = model.run_with_cache(tokens, head_out=any(q.reads_head_writes for q in quantities))
        names = frozenset(q.name for q in quantities)
        run = ProbeRun(model, probe, logits, cache, names, dtype, max_chunk_bytes, step, last)
        for quantity in quantities:
            with timer.part(quantity.name):
                run.results[quantity.name] = quantity.measure(run)
        outputs = [output for q in quantities for output in q.outputs(run.results[q.name], run)]
    finally:
        model.train(was_training)
    return Snapshot(run.results, outputs, timer.seconds)


def quantities_with(options: Mapping[str, Any]) -> list[TrackedQuantity]:
    """The quantities of a one-off snapshot, in their order: every registered one that runs at every
    snapshot, and each scheduled one ``options`` names (one that runs with another, as validity with
    the ablation, when that one is named too). ``options[NAME]``: the quantity itself, its
    ``Options``, a dict of them, True for its defaults, or False to leave it out (even one that runs at
    every snapshot); a measure's (``share``) go to the composition. ``ValueError``, before any work,
    for an unknown name, options with problems, or a quantity left out that a chosen one reads."""
    from metrics.composition.measures import MEASURES

    registry = tracked_quantities()
    unknown = set(options) - set(registry) - set(MEASURES)
    if unknown:
        raise ValueError(f"unknown tracked quantities {sorted(unknown)}; known: {sorted(registry)}")
    left_out = {name for name, value in options.items() if value is False}
    built = {}
    for name, value in options.items():
        if value is False:
            continue
        Options = getattr(registry.get(name) or MEASURES[name], "Options", None)
        if isinstance(value, Mapping) and Options is not None:
            value = Options(**value)
        elif value is True and Options is not None:
            value = Options()
        built[name] = value
    chosen = []
    for name, cls in registry.items():
        if name in left_out:
            continue
        if isinstance(built.get(name), TrackedQuantity):
            chosen.append(built[name])
        elif name in built or cls.Options is None or cls.root_options:
            chosen.append(cls.from_options(built))
    kept = with_companions(chosen, {q.name for q in chosen if q.name in built or not q.runs_with})
    chosen = [q for q in chosen if q.name in kept]
    problems = [f"{q.name}: {p}" for q in chosen for p in getattr(q.options, "problems", list)()]
    problems += [
        f"{q.name} reads {name}: leave it out too ({q.name}=False)"
        for q in chosen
        for name in q.after
        if name in left_out
    ]
    if problems:
        raise ValueError("; ".join(problems))
    return chosen


def take_snapshot(
    model: AttentionOnlyTransformer,
    probe: ProbeBatch,
    *,
    dtype: torch.dtype | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    **options: Any,
) -> Snapshot:
    """Measure ``model`` on ``probe`` at once: every quantity that runs at every snapshot (loss views,
    head scores, the circuit pair, composition), and each scheduled one named in ``options`` (e.g.
    ``ablation=True``, ``writes=True``, ``matching={"every_n_steps": 1}``), every one due. Options by
    quantity name: ``composition={"measures": ["frobenius", "subspace"]}``, ``share={"rows": "all"}``
    (:func:`quantities_with`). ``dtype``: float64 for the exact path."""
    return measure(model, probe, quantities_with(options), dtype=dtype, max_chunk_bytes=max_chunk_bytes)
