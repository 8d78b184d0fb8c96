"""Run directories: what marks one as holding a run, where a resume continues, SLURM's requeued jobs.

A run directory (``outputs/DATE/TIME-MICROSECONDS`` by default) holds ``.hydra/``, ``checkpoints/``,
``csv/metrics.csv``, ``wandb/``, ``tensors/``, the figures and ``train.log``. ``resume=`` takes either
such a directory (training continues in it, from ``checkpoints/last.ckpt``) or a checkpoint file
(training continues from it in a new directory: a fork).
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
RUN_MARKERS = (".hydra", CHECKPOINTS, "csv", "wandb", "tensors", "trajectory", "analysis", "summary.json", "train.log")
RUN_KEY = "run"  # checkpoint["run"] = {"config": the resolved config, "wandb_id": the W&B run id or None}


def holds_a_run(directory: Path) -> list[str]:
    """The run files in ``directory`` (empty when there are none: a fresh or unrelated directory)."""
    return [name for name in RUN_MARKERS if (Path(directory) / name).exists()]


def resume_checkpoint(resume: str) -> Path:
    """The checkpoint a ``resume=`` value names: the file itself, or a run directory's last checkpoint."""
    path = Path(resume)
    return path / CHECKPOINTS / LAST_CHECKPOINT if path.is_dir() else path


def resumed_run_dir(resume: str | None) -> Path | None:
    """The run directory a resume continues in place: ``resume`` itself when it is a directory."""
    if resume is None or not Path(resume).is_dir():
        return None
    return Path(resume).resolve()
