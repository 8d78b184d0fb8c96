"""Every checkpoint says which run it belongs to, and the last step is always checkpointed."""

from __future__ import annotations

from pathlib import Path

import lightning as L


class RunRecord(L.Callback):
    """Merge ``record`` (plain containers: e.g. the run's resolved config and W&B run id) into every
    checkpoint, so that a resume can check what it continues; and save ``checkpoint`` at the end of
    training whatever ``max_steps`` is (the periodic checkpoints may stop short of it)."""

    def __init__(self, record: dict, checkpoint: Path) -> None:
        self.record, self.checkpoint = record, Path(checkpoint)
        self.saved_step: int | None = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint.update(self.record)
        self.saved_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.saved_step != trainer.global_step:
            trainer.save_checkpoint(self.checkpoint)
