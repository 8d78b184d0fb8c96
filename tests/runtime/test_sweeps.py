"""Sweeps with the real train.py and Hydra's launchers: failures stay in their job, every job is one
W&B run in the sweep's group, the sweep is reported as one result, and a re-run finishes it. A sweep
is launched in this process (:func:`tests.helpers.run_train`; its launcher still starts the jobs'
processes) unless the sweep's own process is under test: a signal, a SLURM job, a W&B agent's command.

The launchers come from the ``sweeps`` extra (``pip install -e '.[sweeps]'``); the SLURM launcher
also needs a cluster (CI starts one; see tests/runtime/test_slurm.py).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from records import wandb_records
from reports.run_report import read_series
from tests import warm_start
from tests.helpers import (
    FINISHED,
    NO_FIGURES,
    REPO,
    WITH_WANDB,
    in_this_process,
    job_field,
    require_extra,
    run_train,
    slurm_is_up,
    start_requeued_job_now,
    train_as_main,
    train_env,
    wait_for,
    wandb_history,
)

pytestmark = pytest.mark.slow

QUICK = [
    "trainer.max_steps=30",
    "tracker.every_n_steps=10",
    "tracker.ablation.every_n_steps=0",
    "tracker.writes.every_n_steps=0",
    "tracker.images.every_n_steps=0",
    "trainer.log_every_n_steps=1",
]


def job_table(sweep_dir) -> list[dict]:
    with open(sweep_dir / "sweep_jobs.csv", newline="") as file:
        return list(csv.DictReader(file))


def loss_steps(run_dir) -> list[int]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get("train/loss")]


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory):
    """A 4-job sweep, in this process: one job diverges, two have a bad value, one finishes."""
    sweep = tmp_path_factory.mktemp("failing_sweep")
    result = run_train(
        ["-m", *QUICK, "optim.warmup_steps=0", "optim.lr=1e6,3e-3", "model.n_heads=2,-1", WITH_WANDB], sweep
    )
    return sweep, result


def test_a_failing_job_does_not_stop_the_others_and_is_marked(failing_sweep):
    """One job diverges (W&B: failed), two have a bad value (no W&B run at all), one finishes; the
    sweep exits non-zero and its report marks the three failures. Run with ``figures=false``, its end
    writes the tables and W&B's tables and charts, no figure (the next test draws them)."""
    tmp_path, result = failing_sweep
    assert result.returncode != 0, result.stderr[-3000:]
    rows = {(float(row["optim.lr"]), int(row["model.n_heads"])): row for row in job_table(tmp_path)}
    assert rows[(3e-3, 2)]["status"] == "finished"
    assert [rows[key]["status"] for key in ((1e6, 2), (1e6, -1), (3e-3, -1))] == ["failed"] * 3
    assert "3 of 4 jobs did not finish" in result.stderr
    diverged = tmp_path / rows[(1e6, 2)]["job"]
    assert "training diverged at step" in json.loads((diverged / "status.json").read_text())["error"]
    (run_file,) = diverged.glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_records.exit_code(run_file) == 1  # marked failed in W&B, not successful
    assert not list((tmp_path / rows[(3e-3, -1)]["job"]).glob("wandb"))  # refused before W&B started
    assert (tmp_path / "sweep_jobs.csv").is_file() and (tmp_path / "sweep_groups.csv").is_file()
    assert not list(tmp_path.glob("*.png"))
    assert f"figures: none (figures=false); python -m reports.sweep_report {tmp_path} draws them" in result.stdout
    (report_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # the sweep's summary run, in its group
    report_run = wandb_records.run(report_file)
    assert report_run["display_name"] == "sweep report" and report_run["run_group"] == str(tmp_path)
    (logged,) = wandb_records.history(report_file)
    images = {"sweep/loss_curves/path", "sweep/midpoints/path", "sweep/aligned/path"}
    assert logged["sweep/jobs/nrows"] == 4 and not images & set(logged)
    chart = json.loads((report_file.parent / "files" / logged["sweep/loss_curves_chart_table/path"]).read_text())
    finished = tmp_path / rows[(3e-3, 2)]["job"]
    curve = {step: value for step, line, value in chart["data"] if line.startswith(f"{finished.name}:")}
    steps, values = read_series(finished / "csv" / "metrics.csv")["loss/repeated"]
    assert curve == pytest.approx(dict(zip(steps.tolist(), values.tolist())))  # the chart holds the CSV's curve
    assert wandb_records.exit_code(report_file) == 1


SWEEP_END = """
import sys
from pathlib import Path
from omegaconf import OmegaConf, open_dict
from runtime.sweep_callback import SweepEndReport
sweep = Path(sys.argv[1])
config = OmegaConf.load(sweep / "multirun.yaml")  # what Hydra hands the callback at the multirun's end
with open_dict(config):
    config.hydra.sweep.dir = str(sweep)
    config.figures = config.explorer = True  # as a sweep run with the defaults ends
try:
    SweepEndReport().on_multirun_end(config)
except SystemExit as end:
    print(f"exit: {end.code}")
print("lightning" in sys.modules)
"""


def test_a_sweeps_end_imports_no_lightning(failing_sweep, tmp_path):
    """The sweep's end (the callback Hydra calls, ``SweepEndReport.on_multirun_end``: the report and its
    figures, the sweep's explorer page, its W&B run, the exit) runs in the launching process, which trains
    nothing (the jobs run in joblib's, submitit's or the ensemble's processes): it imports no Lightning,
    which with torchmetrics's optional packages took 5 s at every sweep's end. In a process of its own (this
    one has Lightning loaded; a warm start's has torch and torchmetrics, not Lightning), on a copy of the
    sweep above, with the defaults' figures and page."""
    sweep, _ = failing_sweep
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy, ignore=lambda folder, names: ["wandb"] if Path(folder) == sweep else [])
    command = [sys.executable, "-c", SWEEP_END, str(copy)]
    result = warm_start.run(command, REPO, train_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1:] == ["False"], result.stdout[-2000:]
    assert "exit: error: 3 of 4 jobs did not finish" in result.stdout and (copy / "explorer.html").is_file()
    (report_file,) = copy.glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_records.run(report_file)["display_name"] == "sweep report"
    assert wandb_records.exit_code(report_file) == 1  # three of its jobs failed
    (page,) = copy.glob("wandb/offline-run-*/files/media/html/explorer_*.html")  # its page, as HTML media
    assert page.read_bytes() == (copy / "explorer.html").read_bytes()
    for name in ("sweep_loss_curves.png", "sweep_midpoints.png", "sweep_aligned.png"):
        assert (copy / name).is_file(), name
    (logged,) = wandb_records.history(report_file)
    assert {"sweep/loss_curves/path", "sweep/midpoints/path", "sweep/aligned/path"} <= set(logged)
    assert logged["sweep/emergence_law/_type"] == "image-file" and logged["sweep/emergence/_type"] == "table-file"


def test_joblib_runs_jobs_in_parallel_each_one_w_and_b_run_in_the_sweeps_group(tmp_path):
    require_extra("hydra_plugins.hydra_joblib_launcher", "sweeps")
    result = run_train(
        ["-m", *QUICK, "hydra/launcher=joblib", "seed=0,1", WITH_WANDB], tmp_path
    )  # its jobs: joblib's processes
    assert result.returncode == 0, result.stderr[-3000:]
    assert "is launching 2 jobs" in result.stdout + result.stderr
    for job, seed in (("0", 0), ("1", 1)):
        (run_file,) = (tmp_path / job).glob("wandb/offline-run-*/run-*.wandb")
        run = wandb_records.run(run_file)
        assert (
            run["run_group"] == str(tmp_path)
            and run["display_name"] == f"seed={seed}"
            and f"seed={seed}" in run["tags"]
        )
        assert wandb_records.exit_code(run_file) == 0
        assert loss_steps(tmp_path / job) == list(range(30))
    assert [row["status"] for row in job_table(tmp_path)] == ["finished", "finished"]
    # the same sweep read from its W&B offline runs alone (as copied from a cluster) gives the same numbers
    from reports.sweep_report import sweep_report

    from_wandb = sweep_report([tmp_path / job / "wandb" for job in ("0", "1")], out_dir=tmp_path / "from_wandb")
    from_dirs = sweep_report([tmp_path], out_dir=tmp_path / "from_dirs")
    by_seed = lambda report: {
        row["seed"]: (row["repeated_loss_end"], row["K_frobenius"], row["status"]) for row in report.job_table
    }
    assert by_seed(from_wandb) == by_seed(from_dirs) and len(by_seed(from_dirs)) == 2


def test_submitit_local_runs_a_sweeps_job_in_a_process_of_its_own(tmp_path):
    """One job (a fresh interpreter importing Lightning: ~13 core-seconds each); jobs running side by side are
    joblib's test above, and the SLURM executor's below."""
    require_extra("hydra_plugins.hydra_submitit_launcher", "sweeps")
    result = run_train(["-m", *QUICK, "hydra/launcher=submitit_local", "seed=3", "logger=csv"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(row["seed"], row["status"]) for row in job_table(tmp_path)] == [("3", "finished")]
    assert list(tmp_path.glob(".submitit/*/*_result.pkl"))  # submitit ran it
    assert loss_steps(tmp_path / "0") == list(range(30))


def test_submitit_slurm_sweep_survives_a_pre_timeout_signal(tmp_path):
    """A 2-job sweep on a real SLURM cluster; job 0 gets SLURM's pre-timeout signal, checkpoints,
    is requeued, resumes in place and finishes with every step logged once. Two jobs: submitit submits
    a sweep of two or more as an array, whose task's id (``ARRAYJOB_TASK``) is what requeues it."""
    require_extra("hydra_plugins.hydra_submitit_launcher", "sweeps")
    if not slurm_is_up():
        if os.environ.get("REQUIRE_SLURM"):
            pytest.fail("REQUIRE_SLURM is set but no SLURM cluster answers (sinfo)")
        pytest.skip('no SLURM cluster here: eval "$(.ci/start-local-slurm)" starts one (root, Debian)')
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        f"hydra.sweep.dir={tmp_path}",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.timeout_min=10",
        "hydra.launcher.cpus_per_task=1",
        "seed=0,1",
        "trainer.max_steps=300",  # ~250 steps after the warning: as tests/runtime/test_slurm.py's STEPS
        "tracker.enabled=false",
        "logger=csv",
        "trainer.log_every_n_steps=1",
        "trainer.progress_every_n_steps=10",
    ]
    process = warm_start.popen(command, REPO, train_env(), subprocess.PIPE, subprocess.STDOUT)
    try:
        log = wait_for(lambda: next(iter(tmp_path.glob(".submitit/*_0/*_0_0_log.out")), None), 180, "job 0 to start")
        wait_for(lambda: "step 50/" in log.read_text(), 180, "job 0 to reach step 50")
        job = log.parent.name
        subprocess.run(["scancel", "--signal=USR1", job], check=True)  # the python task is a step: no -b
        wait_for(lambda: job_field(job, "Restarts") == "1", 120, "SLURM to requeue job 0")
        start_requeued_job_now(job)
        # submitit cannot see a job's state here (no accounting), so a relaunch that fails would
        # leave the sweep waiting: watch it in SLURM and fail with its state instead
        state = wait_for(
            lambda: job_field(job, "JobState") in FINISHED and job_field(job, "JobState"),
            300,
            "requeued job 0 to finish",
        )
        assert state == "COMPLETED", (
            f"requeued job 0 ended {state} ({job_field(job, 'Reason')}):\n{log.read_text()[-3000:]}"
        )
        printed, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, printed[-3000:]
    job_log = "".join(p.read_text() for p in log.parent.glob("*_log.*"))
    assert "stopped by SIGUSR1 at step" in job_log and "requeued" in job_log and "resuming" in job_log
    assert [row["status"] for row in job_table(tmp_path)] == ["finished", "finished"]
    for job_dir in ("0", "1"):
        assert loss_steps(tmp_path / job_dir) == list(range(300))


def test_an_interrupted_sweep_rerun_finishes_as_if_uninterrupted(tmp_path):
    """SIGTERM to a sweep in its first job; the same command again resumes that job from its
    checkpoint and runs the rest; a third time skips them all. Every job's CSV and W&B history
    equals the uninterrupted sweep's (one thread: bit-identical), every step once."""
    env = train_env(OMP_NUM_THREADS="1")
    args = [*QUICK, "trainer.max_steps=40", "seed=0,1", WITH_WANDB]
    reference = run_train(["-m", *args], tmp_path / "reference", threads=1)  # in process: the same numbers
    assert reference.returncode == 0, reference.stderr[-3000:]

    interrupted = tmp_path / "interrupted"
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        f"hydra.sweep.dir={interrupted}",
        "trainer.enable_progress_bar=true",
        "trainer.progress_every_n_steps=1",
        NO_FIGURES,
        *args,
    ]
    process = warm_start.popen(command, REPO, env, subprocess.PIPE, subprocess.STDOUT)
    printed, signalled = [], False
    for line in process.stdout:
        printed.append(line)
        if line.startswith("step 17/") and not signalled:  # once: a job 1 that ran would print it too
            process.send_signal(signal.SIGTERM)
            signalled = True
    assert process.wait(timeout=300) == 128 + signal.SIGTERM, "".join(printed)[-3000:]
    status = json.loads((interrupted / "0" / "status.json").read_text())
    assert status["status"] == "preempted", (status, "".join(printed)[-3000:])
    assert not (interrupted / "1").exists()  # the sweep stopped: job 1 never started

    rerun = run_train(["-m", *args], interrupted, threads=1)  # the same command again, in process
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming" in (interrupted / "0" / "train.log").read_text()
    for job in ("0", "1"):
        assert loss_steps(interrupted / job) == list(range(40))
        with (
            open(interrupted / job / "csv" / "metrics.csv", newline="") as a,
            open(tmp_path / "reference" / job / "csv" / "metrics.csv", newline="") as b,
        ):
            assert sorted(map(sorted_row, csv.DictReader(a))) == sorted(map(sorted_row, csv.DictReader(b)))
        assert wandb_history(interrupted / job) == wandb_history(
            tmp_path / "reference" / job
        )  # no step twice, none lost

    again = run_train(["-m", *args], interrupted, threads=1)
    assert again.returncode == 0 and again.stdout.count("finished in an earlier launch of this sweep: skipped") == 2


def sorted_row(row: dict) -> list:
    return sorted((k, v) for k, v in row.items() if v)


def agent_command(spec: dict) -> list[str]:
    """The command line a W&B agent builds for a sweep spec, with each parameter at its first value
    (or a distribution's minimum), made by wandb's own functions as ``wandb agent`` makes it."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    args = {
        name: {"value": p["values"][0] if "values" in p else p.get("value", p.get("min"))}
        for name, p in spec["parameters"].items()
    }
    macros = sweep_utils.create_sweep_command_args({"args": args})
    macros.update(env=["/usr/bin/env"], interpreter=[sys.executable], program=[spec["program"]])
    command = []
    for part in sweep_utils.create_sweep_command(spec["command"]):
        part = str(part)
        command += macros.get(part[2:-1]) or [] if part.startswith("${") and part.endswith("}") else [part]
    return command


@pytest.mark.parametrize("spec_file", sorted((REPO / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_each_wandb_sweep_spec_runs_train_py_as_an_agent_would(spec_file, tmp_path):
    import socket

    import yaml

    spec = yaml.safe_load(spec_file.read_text())
    command = agent_command(spec)
    assert command[:3] == ["/usr/bin/env", sys.executable, "train.py"]
    with socket.socket() as probe:  # a W&B server address that refuses connections: the run logs offline
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = train_env(WANDB_SWEEP_ID="testsweep", WANDB_RUN_ID="agentrun1", WANDB_BASE_URL=f"http://127.0.0.1:{port}")
    env.pop("WANDB_MODE")
    shorter = [
        f"hydra.run.dir={tmp_path}",
        "trainer.max_steps=20",
        "tracker.enabled=false",
        "trainer.enable_progress_bar=false",
    ]
    # train.py with the agent's arguments and environment, in this process (the interpreter that
    # /usr/bin/env starts is not what is tested: how train.py reads what the agent passes is)
    result = in_this_process(train_as_main, command[2:] + shorter, environ=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_records.run_id(run_file) == "agentrun1"  # the agent's run, not one of ours
    config = wandb_records.config(run_file)
    for name in spec["parameters"]:  # the run trained with the values the agent passed
        section, key = name.split(".") if "." in name else (None, name)
        value = config[section][key] if section else config[key]
        assert f"{name}={value}" in command, (name, value, command)


def test_optuna_searches_with_the_objective_each_job_returns(tmp_path):
    require_extra("hydra_plugins.hydra_optuna_sweeper", "sweeps")
    result = run_train(
        [
            "-m",
            "experiment=smallest_cliff",
            "hydra.sweeper.n_trials=3",
            "trainer.max_steps=30",
            "objective_cliff_by=null",
            "tracker.every_n_steps=10",
            "logger=csv",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    optimization = (tmp_path / "optimization_results.yaml").read_text()  # written by the Optuna sweeper
    assert "best_params" in optimization and "best_value" in optimization
    best = float(optimization.split("best_value:")[1].split()[0])
    widths = [int(row["model.d_model"]) for row in job_table(tmp_path)]
    assert len(widths) == 3 and best == min(widths)  # each trial returned its own width
