"""Every file name a run, an analysis or a sweep writes, and what marks a directory as holding a run.

The layout, with what each file holds, is the table in docs/operations.md ("What a run writes"),
which tests/test_house.py checks against these names; no other product module spells a file name.
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
STRATEGIES_FIGURE = "strategies.png"  # the strategy timeline (reports/strategy_timeline.py)
HEADS_FIGURE = "heads.png"  # every head's type over training (reports/head_types.py)
EXPLORER_PAGE = "explorer.html"  # a run's or a sweep's page with one step slider (reports/explorer_page.py)
VALIDITY_TABLE, VALIDITY_FIGURE = "validity.csv", "validity.png"
PAIR_CURVES_FIGURE = "pair_curves.png"
INTERVENTION_RECORD = "intervention.json"  # a run's interventions, their heads as resolved and windows
ANALYSIS_DIR = "analysis"

INDEX_NAME = "index.json"  # trajectory/ and tensors/: what each step's file holds
STEP_FILES = "step-*.safetensors"  # trajectory/ and an analysis's measurements: one file a step


def step_file(step: int) -> str:
    """The file of one step's weights or measurements (``step-00000500.safetensors``)."""
    return f"step-{step:08d}.safetensors"


# analyses over a run's saved weights, in RUN_DIR/analysis/NAME/ (a re-scoring: a run's layout, above)
ANALYSIS_RECORD = "analysis.json"  # written last: the request, the result, the sweep report's columns
STEPS_TABLE = "steps.csv"  # an analysis's row of numbers at each step, unless it names its own table
STAGES_RECORD = "stages.json"  # analysis.stages' record before every analysis wrote ANALYSIS_RECORD: still read
LLC_TABLE, ESSENTIAL_DYNAMICS_TABLE = "llc.csv", "essential_dynamics.csv"
STAGES_FIGURE, ESSENTIAL_DYNAMICS_FIGURE = "stages.png", "essential_dynamics.png"
MEASURED_SETTINGS = "settings.json"  # in an analysis's measurements, RUN_DIR/analysis/.NAME.measured/
CALIBRATION_TABLE, CALIBRATION_FIGURE = "calibration.csv", "traces.png"
EXPORT_CONFIG, EXPORT_WEIGHTS = "config.json", "model.safetensors"  # python -m analysis.export --out DIR


def measurements_dir(analysis_dir: Path) -> Path:
    """Where an analysis keeps each step's measurements until it is written: ``analysis/.NAME.measured``."""
    return analysis_dir.parent / f".{analysis_dir.name}.measured"


SWEEP_CONFIG = "multirun.yaml"  # Hydra's, in the sweep directory: the sweep's overrides
SWEEP_JOBS_TABLE, SWEEP_GROUPS_TABLE = "sweep_jobs.csv", "sweep_groups.csv"
# a sweep with training-time interventions: each group's curves, and the training-time validity table
SWEEP_INTERVENTIONS_FIGURE, SWEEP_TRAINING_VALIDITY = "sweep_interventions.png", "sweep_training_validity.csv"
SWEEP_CURVES_FIGURE, SWEEP_MIDPOINTS_FIGURE, SWEEP_ALIGNED_FIGURE = (
    "sweep_loss_curves.png",
    "sweep_midpoints.png",
    "sweep_aligned.png",
)

# the emergence law (reports/emergence.py): the phase change's step against every numeric value the sweep varied
EMERGENCE_FIGURE, EMERGENCE_TABLE, EMERGENCE_RECORD = "emergence.png", "emergence.csv", "emergence.json"
FORECASTER = "forecaster.json"  # python -m analysis.forecast fit SWEEP_DIR: the phase change's forecaster

ENSEMBLE_RESUME = ".ensemble-resume.ckpt"  # an ensemble's members' checkpoints joined for a resume, in its first member's directory while it resumes

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


SLURM_RUNS = Path("outputs") / ".slurm"  # under a SLURM job's working directory: its run directory, by job id


def resume_hydra_dir(now: str) -> str:
    """Where Hydra's files of a resume go (``.hydra/resume-TIME``), so the run's own ``.hydra/`` stays."""
    return f"{HYDRA_DIR}/resume-{now}"


def run_label(run_dir: Path) -> str:
    """A run's name in figure titles: its directory's last two parts (``2026-11-23/10-00-00-123456``,
    ``SWEEP/3``, ``RUN/analysis``), never a machine's absolute path."""
    return "/".join(Path(run_dir).resolve().parts[-2:])


def run_identity(run_dir: Path) -> str:
    """What a run is: the command that made it, ``python train.py`` and its overrides
    (``.hydra/overrides.yaml``, ``hydra.*`` left out; ``(as shipped)`` with none); "" where it has none readable."""
    import yaml

    try:
        listed = yaml.safe_load((Path(run_dir) / HYDRA_DIR / HYDRA_OVERRIDES).read_text()) or []
    except (OSError, ValueError, yaml.YAMLError):
        return ""
    shown = [str(o) for o in listed if not str(o).startswith("hydra.")] if isinstance(listed, list) else []
    return "python train.py " + (" ".join(shown) if shown else "(as shipped)")


def figure_title(run_dir: Path, width: int = 90) -> str:
    """A run's figure titles' name for it: :func:`run_label` and :func:`run_identity` (cut to ``width``)."""
    identity = run_identity(run_dir)
    if len(identity) > width:
        identity = identity[: width - 1] + "…"
    return f"{run_label(run_dir)} · {identity}" if identity else run_label(run_dir)


def job_dirs(paths: list[Path]) -> list[Path]:
    """The run directories under each path (a sweep directory: its numbered job directories), or
    the path itself when it is a run directory."""
    found: list[Path] = []
    for path in paths:
        if (path / HYDRA_DIR / HYDRA_OVERRIDES).is_file():
            found.append(path)
            continue
        jobs = [p.parent.parent for p in path.glob(f"*/{HYDRA_DIR}/{HYDRA_OVERRIDES}")]
        found.extend(sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)))
    return found


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


class DamagedFile(ValueError):
    """A run file that exists but cannot be read (cut short, overwritten, not what its name says); the
    message is one line that names it. A ValueError: every command's refusal of bad input catches it."""

    def __init__(self, path: Path, error: BaseException | str) -> None:
        why = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        super().__init__(f"{path} is damaged ({why})")
        self.path = Path(path)
