"""``hydra/launcher=ensemble``: a sweep's jobs trained as one batched model, each member a whole run.

Real subprocess runs of ``train.py -m ... hydra/launcher=ensemble`` against real single runs of the
same seeds, read back through the files a user gets (CSV, status, checkpoints, W&B offline runs).
One thread (``OMP_NUM_THREADS=1``): with two, even two single runs of one seed differ in the last bit.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from records import wandb_records
from tests import warm_start
from tests.helpers import (
    NO_FIGURES,
    NO_WANDB,
    REPO,
    WITH_WANDB,
    digest,
    module,
    require_extra,
    run_train,
    run_train_until,
    train_env,
)

pytestmark = pytest.mark.slow

SHORT = [
    "trainer.max_steps=40",
    "trainer.log_every_n_steps=1",
    "trainer.checkpoint_every_n_steps=25",
    "tracker.every_n_steps=5",
    "tracker.all_measures.every_n_steps=20",
    "tracker.ablation.every_n_steps=20",
    "tracker.writes.every_n_steps=20",
    "tracker.images.every_n_steps=0",
    "trajectory.log_steps=3",
    "trajectory.every_n_steps=20",
]
FLOAT64 = ["trainer.precision=64-true", *SHORT]
SINGLE_THREAD = train_env(OMP_NUM_THREADS="1")
INTERVENED = [  # a clamp on the head each member itself makes its previous-token head, then a freeze
    "intervention=clamp_prev_token",
    "intervention.heads=[top_prev_token]",
    "intervention.from_step=12",
    "intervention.until_step=30",
    "+intervention.also=[{kind: freeze, heads: [L1H0], circuit: ov, from_step: 20, until_step: 35}]",
]
LLC = [  # one estimate, at the last step: the model's, each head's and each layer's (one batched SGLD run)
    "stages.llc.every_n_steps=40",
    "stages.llc.chains=2",
    "stages.llc.draws=12",
    "stages.llc.burnin=4",
    "stages.llc.batches=2",
]
EQUAL = [*FLOAT64, *INTERVENED, *LLC]  # the LLC: the llc extra (require_extra in the fixtures)


def ensemble(sweep_dir, *overrides: str, env=SINGLE_THREAD) -> subprocess.CompletedProcess:
    """``python train.py -m hydra/launcher=ensemble OVERRIDES`` in a process of its own, started warm where ``env``
    allows (:mod:`tests.warm_start`), no figures and no W&B run unless OVERRIDES ask (:data:`NO_FIGURES`, :data:`NO_WANDB`)."""
    command = [
        sys.executable,
        "train.py",
        "-m",
        "hydra/launcher=ensemble",
        f"hydra.sweep.dir={sweep_dir}",
        NO_FIGURES,
        NO_WANDB,
        *overrides,
    ]
    return warm_start.run(command, REPO, env, timeout=600)


def in_process_ensemble(sweep_dir, *overrides: str) -> subprocess.CompletedProcess:
    """:func:`ensemble` in this process (:func:`tests.helpers.run_train`), one thread: for what the launcher
    does, where the process itself is not what is tested."""
    return run_train(["-m", "hydra/launcher=ensemble", *overrides], sweep_dir, threads=1)


def logged(run_dir, key: str) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as file:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(file) if row.get(key)}


def csv_rows(run_dir) -> list:
    with open(run_dir / "csv" / "metrics.csv", newline="") as file:
        return sorted((int(row["step"]), sorted((k, v) for k, v in row.items() if v)) for row in csv.DictReader(file))


SOLVED = "strategies/weight/"
"""The mixture reading's weights: SLSQP's answer, whose last bits (1e-13 here) differ between two processes
given the same model outputs (measured: the same inputs solved after different imports), so a member
trained in another process layout matches them to the solver's precision, not bit for bit."""


def split_solved(rows: list) -> tuple[list, list[str], list[float]]:
    """``csv_rows`` without the :data:`SOLVED` keys, and those keys' names and values."""
    kept, names, values = [], [], []
    for step, items in rows:
        kept.append((step, [(k, v) for k, v in items if not k.startswith(SOLVED)]))
        for k, v in items:
            if k.startswith(SOLVED):
                names.append(f"{step}:{k}")
                values.append(float(v))
    return kept, names, values


@pytest.fixture(scope="module")
def float64_ensemble(tmp_path_factory):
    """The ensemble of seeds 0 and 1 with :data:`EQUAL`'s options, trained in this process (its numbers,
    files and W&B runs are what these tests read; the process's signals are tested below)."""
    require_extra("devinterp", "llc")
    sweep = tmp_path_factory.mktemp("ensemble")
    result = run_train(
        ["-m", "hydra/launcher=ensemble", "seed=0,1", *EQUAL, "explorer=true", WITH_WANDB], sweep, threads=1
    )  # the members' pages and the sweep's
    assert result.returncode == 0, result.stderr[-3000:]
    return sweep, result.stdout


@pytest.fixture(scope="module")
def float64_singles(tmp_path_factory) -> dict[int, Path]:
    """``python train.py seed=k`` with the ensemble's options, k = 0, 1: the runs its members must equal."""
    require_extra("devinterp", "llc")
    singles = {}
    for seed in (0, 1):
        singles[seed] = tmp_path_factory.mktemp(f"single{seed}")
        result = run_train([f"seed={seed}", *EQUAL], singles[seed], threads=1)
        assert result.returncode == 0, result.stderr[-3000:]
    return singles


def test_each_member_with_its_interventions_and_llc_equals_its_seeds_single_run_in_float64(
    float64_ensemble, float64_singles
):
    sweep, printed = float64_ensemble
    assert "ensemble of 2 members (jobs 0, 1)" in printed
    assert "ensemble: 2 members in" in printed and "ms a member-step" in printed  # training split from measuring
    member_step = float(printed.split(" ms a member-step")[0].rsplit("(", 1)[1].split(", ")[-1])
    estimates = [
        float(line.split("training ")[1].split(" ms/step")[0]) for line in printed.splitlines() if "ms/step ->" in line
    ]
    assert len(estimates) == 2 and all(e < 3 * member_step for e in estimates), (estimates, member_step)  # its share
    for seed, single in float64_singles.items():
        member = sweep / str(seed)
        record = json.loads((member / "intervention.json").read_text())
        assert record == json.loads((single / "intervention.json").read_text())  # the heads it chose itself
        assert record["interventions"][0]["heads"] and record["interventions"][1]["heads"] == ["L1H0"]
        llc_keys = [f"llc/{group}" for group in ("mean", "L0H0", "L0H1", "L1H0", "L1H1", "L0", "L1")]
        for key in ("train/loss", "loss/repeated", *llc_keys):
            ours, theirs = logged(member, key), logged(single, key)
            assert sorted(ours) == sorted(theirs), key
            assert sorted(ours) == [40] if key in llc_keys else len(ours) >= 9, key
            worst = max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in theirs)
            # measured: 3.2e-16 for train/loss (the members' batched matmuls add in another order), 0 for the
            # rest; 1e-12 leaves a BLAS that orders other sums differently its few ulps per step
            assert worst <= 1e-12, (key, seed, worst)


def test_each_member_is_a_whole_run_with_its_own_wandb_run_in_the_sweeps_group(float64_ensemble):
    sweep, _ = float64_ensemble
    ids = set()
    for seed in (0, 1):
        member = sweep / str(seed)
        for name in (
            "summary.json",
            "validity.csv",
            "train.log",
            ".hydra",
            "explorer.html",
        ):
            assert (member / name).exists(), name
        assert json.loads((member / "status.json").read_text())["status"] == "finished"
        assert sorted(p.name for p in (member / "trajectory").glob("step-*.safetensors"))
        assert sorted((member / "tensors").glob("*.steps"))
        checkpoint = torch.load(member / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert checkpoint["global_step"] == 40 and checkpoint["run"]["ensemble"]["index"] == seed
        assert checkpoint["state_dict"]["model.W_E"].shape == (257, 64)  # the single model's layout
        (run_file,) = member.glob("wandb/offline-run-*/run-*.wandb")
        assert wandb_records.exit_code(run_file) == 0
        ids.add(run_file.parent.name)
    member = sweep / "1"  # the reports read a member unchanged: its figures drawn (one is enough: ~2.5 s each)
    report = module("reports.run_report", member)
    assert report.returncode == 0 and "final/loss/repeated" in report.stdout, report.stderr[-2000:]
    assert (member / "phase_change.png").is_file() and (member / "strategies.png").is_file()
    assert len(ids) == 2
    assert (sweep / "sweep_jobs.csv").is_file() and (sweep / "explorer.html").is_file()


def test_a_diverged_member_is_stopped_and_marked_failed_while_the_others_finish(tmp_path):
    result = in_process_ensemble(
        tmp_path,
        "optim.lr=1e-3,1e30",
        "trainer.max_steps=20",
        "tracker.every_n_steps=5",
        "tracker.images.every_n_steps=0",
    )
    assert result.returncode != 0  # the sweep reports a job that did not finish
    good, bad = (json.loads((tmp_path / k / "status.json").read_text()) for k in ("0", "1"))
    assert good["status"] == "finished" and (tmp_path / "0" / "summary.json").is_file()
    assert bad["status"] == "failed" and "training diverged at step" in bad["error"]
    assert logged(tmp_path / "0", "train/loss").keys() >= {9, 19}


def test_jobs_of_different_shapes_train_as_one_ensemble_per_shape_said_in_one_line(tmp_path):
    result = in_process_ensemble(
        tmp_path,
        "model.d_model=32,64",
        "seed=0,1",
        "trainer.max_steps=3",
        "tracker.enabled=false",
        "trajectory.enabled=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("ensemble: 4 jobs in 2 groups")]
    assert "model" in line and "(jobs 0,1 | 2,3)" in line
    assert all(json.loads((tmp_path / str(k) / "status.json").read_text())["status"] == "finished" for k in range(4))


def test_split_by_trains_the_jobs_of_each_value_as_an_ensemble_of_their_own(tmp_path):
    """``hydra.launcher.split_by=[data.block]``: jobs of one shape split by that key's value (as
    experiment=emergence splits its two context meanings, which stop at different steps)."""
    args = ["data.block=fixed,half_context", "seed=0,1", "trainer.max_steps=3", "tracker.enabled=false"]
    result = in_process_ensemble(tmp_path, "hydra.launcher.split_by=[data.block]", *args, "trajectory.enabled=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ensemble: 4 jobs in 2 groups that differ in data.block (jobs 0,1 | 2,3)" in result.stdout
    unknown = in_process_ensemble(tmp_path / "unknown", "hydra.launcher.split_by=[data.blok]", *args)
    assert unknown.returncode == 1 and not (tmp_path / "unknown" / "0").exists()
    (line,) = [line for line in unknown.stderr.splitlines() if line.strip()]
    assert "hydra.launcher.split_by names data.blok, which the config does not have" in line


def test_with_n_jobs_a_part_starts_as_soon_as_another_ends(tmp_path):
    """Three parts, two at a time: the third (10 steps) starts when the second (10 steps) ends, while the
    first (300 steps) still trains, rather than after the first two have both ended."""
    result = in_process_ensemble(
        tmp_path,
        "hydra.launcher.n_jobs=2",
        "trainer.max_steps=300,10,12",
        "trainer.num_threads=1",
        "tracker.enabled=false",
        "trajectory.enabled=false",
        NO_FIGURES,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ensemble: 3 jobs in 3 groups" in result.stdout
    ended = {job: (tmp_path / job / "status.json").stat().st_mtime for job in "012"}
    assert ended["1"] < ended["2"] < ended["0"], ended  # two at a time, the third ends before the first


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["seed=range(0,0)"], "error: the ensemble has no members"),
        (["seed=0,1", "model.d_model=0"], "config error: job 0"),
    ],
    ids=["empty", "invalid"],
)
def test_bad_input_is_one_line_and_a_non_zero_exit_before_any_work(tmp_path, overrides, message):
    result = ensemble(tmp_path, *overrides)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # no job directory made


def test_resuming_a_single_run_as_an_ensemble_is_refused_in_one_line(float64_singles, tmp_path):
    single = float64_singles[0]
    before = digest(single)
    result = ensemble(tmp_path / "sweep", f"resume={single}", "trainer.max_steps=8")
    assert result.returncode == 1
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert "was trained alone, not as an ensemble member" in line
    assert not (tmp_path / "sweep" / "0").exists() and digest(single) == before


def test_resuming_one_member_alone_is_refused_in_one_line(float64_ensemble):
    sweep, _ = float64_ensemble
    command = [sys.executable, "train.py", f"resume={sweep / '0'}", "trainer.max_steps=80"]
    result = warm_start.run(command, REPO, train_env(), timeout=300)
    assert result.returncode == 1
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert "is a member of an ensemble" in line and "hydra/launcher=ensemble" in line


def test_a_stop_signal_reaches_both_processes_checkpoints_each_ensemble_at_one_step_and_the_command_resumes_exactly(
    tmp_path,
):
    """Four seeds as two ensembles of two, each in a process of its own (``n_jobs=2``), SIGTERM once one
    prints step 13: that part stops inside a clamp's window (steps 12-30), before a freeze's; the other part,
    racing it in its own process, stops at the end of whatever step it is at (one still starting: after its
    first), which this test does not choose. Every ensemble's members stop at one step; the same command
    resumes them, and every member's CSV and intervention record equal those of one uninterrupted ensemble
    of the four, trained in this process (one thread: a member's numbers do not depend on its batch)."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    options = ["hydra.launcher.n_jobs=2", "trainer.num_threads=1", "seed=0,1,2,3", *SHORT, *INTERVENED]
    reference = ["hydra/launcher=ensemble", "seed=0,1,2,3", *SHORT, *INTERVENED]  # one ensemble of four, in process
    result = run_train(["-m", *reference], straight, threads=1)
    assert result.returncode == 0, result.stderr[-3000:]
    args = ["hydra/launcher=ensemble", f"hydra.sweep.dir={stopped}", *options]
    code, printed = run_train_until(args, step=13, signum=signal.SIGTERM, multirun=True)
    assert code == 128 + signal.SIGTERM, printed[-3000:]
    assert "ensemble: 2 ensembles of 2, 2 members, 2 at a time" in printed
    steps = []
    for k in range(4):
        status = json.loads((stopped / str(k) / "status.json").read_text())
        checkpoint = torch.load(stopped / str(k) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert status["status"] == "preempted" and checkpoint["global_step"] == status["step"] >= 1, status
        steps.append(status["step"])
    assert steps[0] == steps[1] and steps[2] == steps[3], steps  # an ensemble's members stop together
    assert any(13 <= step < 25 for step in steps), steps  # the part that printed step 13: both members in the clamp
    resumed = in_process_ensemble(stopped, *options)  # the same command again, in this process
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # as launched, whether the parts stopped at one step or two (two groups then share the two processes)
    assert "ensemble: 2 ensembles of 2, 2 members, 2 at a time" in resumed.stdout, resumed.stdout[-3000:]
    for k in range(4):
        assert f"2 members at step {steps[k]}, in place" in (stopped / str(k) / "train.log").read_text()
        rows, names, weights = split_solved(csv_rows(stopped / str(k)))
        expected, expected_names, expected_weights = split_solved(csv_rows(straight / str(k)))
        assert rows == expected  # every step once, every value but the mixture's weights bit for bit
        assert names == expected_names and weights == pytest.approx(expected_weights, rel=1e-9, abs=1e-12)
        record = json.loads((stopped / str(k) / "intervention.json").read_text())
        assert record == json.loads((straight / str(k) / "intervention.json").read_text())
        assert json.loads((stopped / str(k) / "status.json").read_text())["status"] == "finished"


def test_a_members_own_stop_finishes_that_member_alone():
    """``tracker.stop_after_phase_change`` in an ensemble: a member's callback that sets ``should_stop`` on
    its trainer marks that member done (the dispatcher finishes it at this step) and leaves the ensemble's
    trainer training the others. The whole path, measured: three seeds as one ensemble stop at the steps
    and midpoints of their single runs (docs/emergence.md)."""
    from types import SimpleNamespace

    from callbacks.ensemble_members import Member, MemberTrainer

    ensemble_trainer = SimpleNamespace(should_stop=False, global_step=700)
    member = Member(0, Path("run"), [], [], {}, Path("run/last.ckpt"))
    proxy = MemberTrainer(ensemble_trainer, member, save=lambda m: None, clock=lambda: 0.0)
    assert not proxy.should_stop
    proxy.should_stop = True
    assert member.done and proxy.should_stop and not ensemble_trainer.should_stop
    other = Member(1, Path("other"), [], [], {}, Path("other/last.ckpt"))
    assert not MemberTrainer(ensemble_trainer, other, save=lambda m: None, clock=lambda: 0.0).should_stop
