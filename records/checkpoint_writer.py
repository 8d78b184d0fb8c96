"""A checkpoint replaced whole or not at all.

Lightning's own checkpoint writing (``TorchCheckpointIO``) writes to a temporary file in the system's
temporary directory and moves it over ``last.ckpt``; where that directory is on another filesystem the
move is a copy, and a disk that fills during it leaves ``last.ckpt`` cut short: the checkpoint from
before is gone too. :class:`SameDirectoryCheckpointIO` (a Lightning ``CheckpointIO`` plugin, its public
switch) writes beside the checkpoint and renames, so the one before stays whole until the new one is."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from records.disk import WRITING_SUFFIX


class SameDirectoryCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, writing each checkpoint to ``.NAME.writing`` beside it and renaming
    it over ``NAME`` once whole (an atomic replace on one filesystem); a write that fails (a full disk)
    leaves the checkpoint from before as it was, and its partial file is deleted."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        temporary = path.with_name(f".{path.name}{WRITING_SUFFIX}")
        try:
            super().save_checkpoint(checkpoint, temporary, storage_options)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
