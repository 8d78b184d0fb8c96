"""What a run continues: nothing, or a checkpoint, in place or into a new directory (``resume=``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from records.layout import RUN_KEY, resume_checkpoint, resumed_run_dir


@dataclass(frozen=True)
class Continuation:
    """What a run continues: nothing, or a checkpoint; in place (same directory, CSV and W&B run) when
    ``resume`` names the run directory itself."""

    checkpoint: Path | None = None
    step: int = 0  # the checkpoint's global step: the first step this run logs
    in_place: bool = False
    wandb_id: str | None = None  # the W&B run to continue (in place only)

    @classmethod
    def of(cls, cfg: DictConfig, run_dir: Path) -> Continuation:
        if cfg.resume is None:
            return cls()
        checkpoint = resume_checkpoint(cfg.resume)
        state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
        in_place = resumed_run_dir(cfg.resume) == Path(run_dir).resolve()
        record = state.get(RUN_KEY) or {}
        return cls(checkpoint, int(state["global_step"]), in_place, record.get("wandb_id") if in_place else None)

    def announce(self, run_dir: Path) -> None:
        """Say what is resumed, where (nothing when the run starts afresh)."""
        if self.checkpoint is not None:
            where = "in place" if self.in_place else f"into {run_dir}"
            print(f"resuming {self.checkpoint} at step {self.step}, {where}")
