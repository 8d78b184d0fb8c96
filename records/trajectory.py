"""A run's weight trajectory on disk: the model's weights at chosen steps, safe to load.

``RUN_DIR/trajectory/`` holds one ``safetensors`` file per kept step (weights only, no optimizer
state: a safetensors file is tensors and a JSON header, so loading one runs no code) and an index:

    index.json                {"version": 1, "format": "safetensors", "shape": {TransformerShape},
                               "config": {the run's resolved config}, "run": {"wandb_id", "wandb_group", "wandb_name"},
                               "steps": {"500": {"file": "step-00000500.safetensors", "reasons": ["linear"], "bytes": N}}}
    step-00000500.safetensors the model's ``state_dict()`` at step 500 (``W_E``, ``W_pos``,
                              ``layers.{l}.W_{Q,K,V,O}``, norm gains, ``W_U``), in its training dtype

Each file is written to a temporary name and renamed, then the index is rewritten atomically, so
a killed run leaves whole files that the index names, or an orphan it does not.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from models.transformer import AttentionOnlyTransformer, TransformerShape
from records.layout import INDEX_NAME, TRAJECTORY_DIR, step_file

FORMAT = "safetensors"


HEADER_BYTES = 4096
"""A safetensors header, generously: its JSON names every tensor and its shape."""


def sparse_steps(
    max_steps: int, log_steps: int, every_n_steps: int, events: tuple[int, ...] = ()
) -> dict[int, list[str]]:
    """``{step: reasons}``: step 0, ``log_steps`` log-spaced steps in [1, max_steps] (rounded, so
    fewer when they collide near 1), every ``every_n_steps``-th step (0: none), ``events`` (the steps
    around a training-time intervention's start and end) and ``max_steps``."""
    steps: dict[int, list[str]] = {0: ["log"], max_steps: ["final"]}
    for step in events:
        if 0 <= step <= max_steps:
            steps.setdefault(step, []).append("intervention")
    if log_steps > 0:
        for i in range(log_steps):
            exponent = i / (log_steps - 1) if log_steps > 1 else 1.0
            steps.setdefault(round(max_steps**exponent), []).append("log")
    if every_n_steps > 0:
        for step in range(0, max_steps + 1, every_n_steps):
            steps.setdefault(step, []).append("linear")
    return {step: sorted(set(reasons)) for step, reasons in sorted(steps.items())}


DEFAULT_BUDGET_MB = 40.0
"""The budget when ``trajectory.budget_mb`` is not set, for a model small enough that it holds
:data:`DEFAULT_BUDGET_STEPS` of its steps."""
DEFAULT_BUDGET_STEPS = 16
"""When ``trajectory.budget_mb`` is not set, the budget always holds this many steps of the model (a
paper-size 12-layer model's step is ~110 MB: 40 MB would hold none), with half of it for the phase
change when the trigger is on."""


def default_budget(bytes_per_step: int) -> int:
    """The budget in bytes when none is set: :data:`DEFAULT_BUDGET_MB`, or room for
    :data:`DEFAULT_BUDGET_STEPS` steps of this model when that is larger."""
    return max(int(DEFAULT_BUDGET_MB * 2**20), DEFAULT_BUDGET_STEPS * bytes_per_step)


@dataclass(frozen=True)
class TrajectoryPlan:
    """The sparse steps that fit ``budget`` bytes: the linear grid thinned first (its period doubled),
    then the log-spaced one (halved); with an adaptive trigger only half the budget goes to them.
    ``budget`` None: :func:`default_budget` of ``bytes_per_step``; ``events`` are never thinned."""

    steps: dict[int, list[str]]
    log_steps: int
    every_n_steps: int
    bytes_per_step: int
    budget: int

    @classmethod
    def fit(
        cls,
        max_steps: int,
        log_steps: int,
        every_n_steps: int,
        bytes_per_step: int,
        budget: int | None,
        adaptive: bool,
        events: tuple[int, ...] = (),
    ) -> TrajectoryPlan:
        budget = default_budget(bytes_per_step) if budget is None else budget
        room = budget // 2 if adaptive else budget
        fits = lambda: len(sparse_steps(max_steps, log_steps, every_n_steps, events)) * bytes_per_step <= room
        while not fits() and every_n_steps and every_n_steps < max_steps:
            every_n_steps *= 2
        if not fits():
            every_n_steps = 0
        while not fits() and log_steps > 1:
            log_steps //= 2
        if not fits():
            raise ValueError(
                f"a budget of {budget / 2**20:.3g} MB holds fewer than the first and last step"
                f" ({bytes_per_step / 2**20:.2f} MB each{', half the budget kept for the phase change' * adaptive})"
            )
        steps = sparse_steps(max_steps, log_steps, every_n_steps, events)
        return cls(steps, log_steps, every_n_steps, bytes_per_step, budget)


class TrajectoryError(ValueError):
    """A trajectory that cannot be read as asked: the message names the file or step and why."""


class TrajectoryWriter:
    """Adds steps to ``directory`` (created if missing); keeps an existing index (a resumed run)."""

    def __init__(self, directory: str | Path, shape: TransformerShape, config: dict, run: dict | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        index_path = self.directory / INDEX_NAME
        existing = json.loads(index_path.read_text()) if index_path.is_file() else {}
        self.index = {
            "version": 1,
            "format": FORMAT,
            "shape": asdict(shape),
            "config": config,
            "run": run or {},
            "steps": existing.get("steps", {}),
        }

    @property
    def steps(self) -> list[int]:
        return sorted(int(step) for step in self.index["steps"])

    @property
    def bytes(self) -> int:
        return sum(entry["bytes"] for entry in self.index["steps"].values())

    def add(self, step: int, state_dict: dict[str, torch.Tensor], reasons: list[str]) -> None:
        """Write ``state_dict`` as ``step`` (a step kept already: its reasons are merged, no rewrite)."""
        entry = self.index["steps"].get(str(step))
        if entry is not None:
            entry["reasons"] = sorted(set(entry["reasons"]) | set(reasons))
        else:
            name = step_file(step)
            temporary = self.directory / f"{name}.tmp"
            tensors = {key: value.detach().cpu().contiguous() for key, value in state_dict.items()}
            try:
                save_file(tensors, str(temporary), metadata={"step": str(step)})
            except SafetensorError as error:  # its message only: a full disk becomes the OSError it is
                temporary.unlink(missing_ok=True)
                if "No space left on device" in str(error):
                    raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / name)) from error
                raise
            os.replace(temporary, self.directory / name)
            self.index["steps"][str(step)] = {
                "file": name,
                "reasons": sorted(reasons),
                "bytes": (self.directory / name).stat().st_size,
            }
        self._write_index()

    def truncate_after(self, step: int) -> None:
        """Forget (and delete) every kept step after ``step``: a resume continues from its checkpoint."""
        dropped = [key for key in self.index["steps"] if int(key) > step]
        for key in dropped:
            (self.directory / self.index["steps"].pop(key)["file"]).unlink(missing_ok=True)
        if dropped:
            self._write_index()

    def _write_index(self) -> None:
        temporary = self.directory / f"{INDEX_NAME}.tmp"
        temporary.write_text(json.dumps(self.index, indent=1))
        os.replace(temporary, self.directory / INDEX_NAME)


class Trajectory:
    """A run's saved weights, read-only: ``steps``, the model ``shape``, the run's ``config``."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir / TRAJECTORY_DIR
        index_path = self.directory / INDEX_NAME
        if not index_path.is_file():
            raise TrajectoryError(
                f"{self.run_dir} has no {TRAJECTORY_DIR}/{INDEX_NAME}: the run kept no weights "
                "(trajectory.enabled=false, or not a train.py run directory)"
            )
        try:
            self.index = json.loads(index_path.read_text())
            self.shape = TransformerShape(**self.index["shape"])
            self.config, self.run = self.index["config"], self.index.get("run", {})
            self.entries = {int(step): entry for step, entry in self.index["steps"].items()}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise TrajectoryError(f"{index_path} is not a trajectory index ({type(error).__name__}: {error})") from None
        if self.index.get("format") != FORMAT:
            raise TrajectoryError(f"{index_path}: format {self.index.get('format')!r}, expected {FORMAT!r}")
        self.steps = sorted(self.entries)

    @cached_property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The model's tensors and their shapes, every saved step's to match (built once: a model on the
        meta device costs ~20 ms)."""
        return {name: tuple(p.shape) for name, p in _meta_model(self.shape).state_dict().items()}

    def path(self, step: int) -> Path:
        if step not in self.entries:
            raise TrajectoryError(
                f"step {step} was not saved in {self.directory} (saved: {describe_steps(self.steps)})"
            )
        return self.directory / self.entries[step]["file"]

    def check(self, step: int) -> None:
        """Raise :class:`TrajectoryError` unless ``step``'s file is whole and holds this model's
        tensors with their shapes (reads the header only)."""
        path = self.path(step)
        if not path.is_file():
            raise TrajectoryError(f"{path}: missing (the index names it)")
        size, indexed = path.stat().st_size, self.entries[step]["bytes"]
        if size != indexed:
            raise TrajectoryError(f"{path}: {size} bytes where the index says {indexed} (truncated or replaced)")
        expected = self.tensor_shapes
        try:
            with safe_open(str(path), "pt") as file:
                found = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
        except (SafetensorError, OSError, ValueError) as error:
            raise TrajectoryError(f"{path}: not a safetensors file ({str(error).splitlines()[0][:120]})") from None
        if found != expected:
            missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
            wrong = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
            raise TrajectoryError(
                f"{path}: not this run's model (missing {missing[:3]}, unexpected {extra[:3]}, other shapes {wrong[:3]})"
            )

    def state_dict(self, step: int) -> dict[str, torch.Tensor]:
        self.check(step)
        return load_file(str(self.path(step)))

    def model(self, step: int, device: str | torch.device = "cpu") -> AttentionOnlyTransformer:
        """The model at ``step``, in eval mode (built without random initialisation: no RNG is drawn)."""
        model = _meta_model(self.shape)
        model.load_state_dict(self.state_dict(step), assign=True)
        return model.to(device).eval()


def _meta_model(shape: TransformerShape) -> AttentionOnlyTransformer:
    with torch.device("meta"):
        return AttentionOnlyTransformer(shape)


def describe_steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[:6])) + (f", ... {steps[-1]}" if len(steps) > 6 else "")
    return f"{len(steps)} steps: {shown}"
