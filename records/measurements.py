"""An analysis's measurements, step by step, as they are made: what lets a stopped analysis continue.

``RUN_DIR/analysis/.NAME.measured/`` holds one safetensors file a step (its tensors, its row of
numbers in the header) and ``settings.json``, what they were measured with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from records.layout import MEASURED_SETTINGS, STEP_FILES, step_file

ROW_KEY = "row"  # the safetensors header entry holding the step's row, as JSON


class MeasuredSteps:
    """Each step's measurements (a row of numbers and named tensors), saved as soon as they are
    made, so that an interrupted analysis (Ctrl-C, a time limit, a crash) continues where it
    stopped when run again with the same settings, and a finished one is read again (``--overwrite``
    with other reading settings, other ``--steps``) without measuring what is there; other
    measurement ``settings`` discard them (said in one line)."""

    def __init__(self, directory: Path, settings: dict, label: str = "analysis") -> None:
        self.directory = Path(directory)
        wanted = json.dumps(settings, sort_keys=True)
        saved = self.directory / MEASURED_SETTINGS
        if self.directory.exists() and (not saved.is_file() or saved.read_text() != wanted):
            print(f"{label}: {self.directory} holds steps measured with other settings: measuring afresh", flush=True)
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        saved.write_text(wanted)
        self.steps = sorted(int(p.stem.removeprefix("step-")) for p in self.directory.glob(STEP_FILES))

    def path(self, step: int) -> Path:
        return self.directory / step_file(step)

    def get(self, step: int) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """``(row, tensors)`` of ``step``, or None when it was not measured."""
        from safetensors import safe_open

        if step not in self.steps:
            return None
        with safe_open(self.path(step), framework="pt") as handle:
            return json.loads(handle.metadata()[ROW_KEY]), {name: handle.get_tensor(name) for name in handle.keys()}

    def put(self, step: int, row: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Save ``step``'s measurements whole or not at all (a kill mid-write leaves no half step)."""
        from safetensors.torch import save_file

        written = self.path(step).with_suffix(".tmp")
        save_file(
            {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
            written,
            metadata={ROW_KEY: json.dumps(row)},
        )
        written.replace(self.path(step))
        self.steps.append(step)
