"""Every file name of a run directory, and what marks a directory as holding a run.

A run directory (``outputs/DATE/TIME-MICROSECONDS`` by default; a sweep's job: ``SWEEP_DIR/N``)::

    .hydra/                    Hydra's config.yaml, overrides.yaml, hydra.yaml
    train.log                  everything the run printed
    status.json                running | finished | failed | preempted, and why (records/status.py)
    checkpoints/last.ckpt      the last checkpoint (model, optimizer, data position, the run record)
    csv/metrics.csv            every logged scalar (records/csv_log.py)
    tensors/                   every snapshot's full tensors (records/tensor_store.py)
    trajectory/                the weights over training (records/trajectory.py)
    wandb/                     W&B's offline run
    summary.json               the phase change and final values (reports/run_report.py)
    phase_change.png, composition.png, validity.csv, validity.png, pair_curves.png
    analysis/NAME/             an analysis of the trajectory: a re-scoring (analysis/rescore.py), laid out as
                               above; stages (analysis/stages.py); the LLC's calibration (analysis/calibrate_llc.py)

A sweep directory holds its jobs and ``sweep_jobs.csv``, ``sweep_groups.csv`` and three figures.
``resume=`` takes a run directory (training continues in it) or a checkpoint file (a fork).
"""

from __future__ import annotations

from pathlib import Path

HYDRA_DIR = ".hydra"
HYDRA_CONFIG, HYDRA_OVERRIDES = "config.yaml", "overrides.yaml"
TRAIN_LOG = "train.log"
STATUS_FILE = "status.json"
CHECKPOINTS = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
CSV_DIR = "csv"
CSV_RELATIVE_PATH = Path(CSV_DIR) / "metrics.csv"
TENSORS_DIR = "tensors"
TRAJECTORY_DIR = "trajectory"
WANDB_DIR = "wandb"
SUMMARY_NAME = "summary.json"
PHASE_CHANGE_FIGURE = "phase_change.png"
COMPOSITION_FIGURE = "composition.png"
VALIDITY_TABLE, VALIDITY_FIGURE = "validity.csv", "validity.png"
PAIR_CURVES_FIGURE = "pair_curves.png"
ANALYSIS_DIR = "analysis"

SWEEP_JOBS_TABLE, SWEEP_GROUPS_TABLE = "sweep_jobs.csv", "sweep_groups.csv"
SWEEP_CURVES_FIGURE, SWEEP_MIDPOINTS_FIGURE, SWEEP_ALIGNED_FIGURE = (
    "sweep_loss_curves.png",
    "sweep_midpoints.png",
    "sweep_aligned.png",
)

RUN_MARKERS = (
    HYDRA_DIR,
    CHECKPOINTS,
    CSV_DIR,
    WANDB_DIR,
    TENSORS_DIR,
    TRAJECTORY_DIR,
    ANALYSIS_DIR,
    SUMMARY_NAME,
    TRAIN_LOG,
)
RUN_KEY = "run"  # checkpoint["run"] = {"config": the resolved config, "wandb_id": the W&B run id or None}


def run_label(run_dir: Path) -> str:
    """A run's name in figure titles: its directory's last two parts (``2026-11-23/10-00-00-123456``,
    ``SWEEP/3``, ``RUN/analysis``), never a machine's absolute path."""
    return "/".join(Path(run_dir).resolve().parts[-2:])


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
