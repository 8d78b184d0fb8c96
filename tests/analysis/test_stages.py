"""Developmental stages of real ``train.py`` runs, as a user asks for them: ``python -m
analysis.stages`` on a run and on a sweep, the calibration command, and the one-line answer when
the ``llc`` extra is missing."""

from __future__ import annotations

import csv
import json
import math
import signal
import subprocess
import sys

import pytest
import torch

from records import wandb_records
from tests import warm_start
from tests.helpers import NO_FIGURES, REPO, TINY, digest, module, require_extra, run_train, train_env

pytestmark = pytest.mark.slow

QUICK = [
    "stages.llc.chains=2",
    "stages.llc.draws=12",
    "stages.llc.burnin=4",
    "stages.llc.batches=2",
    "stages.sequences=8",
]


@pytest.fixture(scope="module")
def trained(tiny_run):
    require_extra("devinterp", "llc")
    assert tiny_run.returncode == 0, tiny_run.stderr[-3000:]
    return tiny_run.run_dir


def test_stages_of_a_run_write_every_output_and_touch_nothing_else(trained):
    before = digest(trained)
    result = module("analysis.stages", trained, *QUICK)
    assert result.returncode == 0, result.stderr[-3000:]
    out = trained / "analysis" / "stages"
    record = json.loads((out / "analysis.json").read_text())
    stages, steps = record["result"], record["steps"]
    assert steps == sorted(steps) and len(steps) >= 5
    with open(out / "llc.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == steps
    assert all(float(r["llc_std"]) >= 0 and r["llc_settled"] in ("0.0", "1.0") for r in rows)
    assert len(stages["heads"]) == 4 and all(f"llc_{h}" in rows[0] for h in stages["heads"])  # every head of 2 x 2
    assert {"llc_L0", "llc_L1", "llc_L0_std", "llc_L1_diverged"} <= rows[0].keys()  # and every layer
    types = stages["head_types"]
    assert set(types["types"]) == set(stages["heads"]) and -1 <= types["weight_refined"]["ari"] <= 1
    assert 0 <= types["weight_refined"]["ari_p"] <= 1 and (out / "heads.png").stat().st_size > 10_000
    with open(out / "essential_dynamics.csv") as handle:
        assert list(csv.DictReader(handle))[0].keys() == {"step", "PC1", "PC2", "PC3"}
    assert (out / "stages.png").stat().st_size > 10_000 and (out / "essential_dynamics.png").stat().st_size > 10_000
    assert "s per LLC estimate" in result.stdout and f"stages: {len(steps)} steps, " in result.stdout
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    logged = [row for row in wandb_records.history(run_file) if "stages/llc_mean" in row]
    assert [row["trainer/global_step"] for row in logged] == steps  # on training's step axis
    assert digest(trained) == before  # the run's own files are untouched
    again = module("analysis.stages", trained, *QUICK)
    assert again.returncode == 2 and "exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_a_diverged_chain_is_nan_named_and_the_rest_of_the_trajectory_goes_on(trained):
    result = module(
        "analysis.stages", trained, *QUICK, "stages.llc.heads=false", "stages.llc.lr=10", "--name", "diverged"
    )
    assert result.returncode == 1, result.stderr[-3000:]  # written, but not reported as a success
    out = trained / "analysis" / "diverged"
    record = json.loads((out / "analysis.json").read_text())
    stages = record["result"]
    assert record["incomplete"] and stages["diverged"] == {str(step): ["model"] for step in record["steps"]}
    assert stages["llc_seconds_per_estimate"] is None
    with open(out / "llc.csv") as handle:
        assert all(row["llc_mean"] == "nan" and row["llc_diverged"] == "1.0" for row in csv.DictReader(handle))
    assert f"warning: an SGLD chain diverged at steps {record['steps'][0]} (model), " in result.stdout
    assert (out / "stages.png").is_file() and (out / "essential_dynamics.csv").is_file()


def test_an_interrupted_analysis_continues_where_it_stopped(trained):
    # 25 draws a step (~0.6 s on 2 cores, 6 steps): the Ctrl-C after the first step's line must land while
    # steps remain (~3 s of them), however far a loaded machine lets this process fall behind reading the output
    args = [*QUICK, "stages.llc.heads=false", "stages.llc.draws=25"]
    whole = module("analysis.stages", trained, *args, "--name", "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    command = [sys.executable, "-m", "analysis.stages", str(trained), *args, "--name", "cut"]
    # a shell that starts jobs in the background (`... &`, as CI scripts may) hands them SIGINT
    # ignored, and Python then keeps it ignored: restore the default, so Ctrl-C is KeyboardInterrupt
    process = warm_start.popen(command, REPO, train_env(), subprocess.PIPE, sigint="default")
    printed = ""
    for line in process.stdout:
        printed += line
        if line.startswith("stages: step ") and " (1/" in line:  # one step measured: Ctrl-C
            process.send_signal(signal.SIGINT)
    process.wait(timeout=120)
    measured = trained / "analysis" / ".cut.measured"
    assert process.returncode == 130 and "the same command continues from there" in printed, printed
    assert not (trained / "analysis" / "cut").exists() and list(measured.glob("step-*.safetensors"))
    again = module("analysis.stages", trained, *args, "--name", "cut")
    assert again.returncode == 0 and "stages: continuing: " in again.stdout, again.stdout + again.stderr[-2000:]
    assert len(list(measured.glob("step-*.safetensors"))) == len(
        json.loads((trained / "analysis" / "cut" / "analysis.json").read_text())["steps"]
    )

    def measured(name, table):  # every number but how long each estimate took
        with open(trained / "analysis" / name / table) as handle:
            return [{k: float(v) for k, v in row.items() if k != "llc_seconds"} for row in csv.DictReader(handle)]

    # Equal up to float rounding: two processes' BLAS kernels may sum in another order (CI saw
    # 2e-6 relative after an SGLD chain), so not bit for bit.
    for table in ("llc.csv", "essential_dynamics.csv"):
        cut, whole = measured("cut", table), measured("whole", table)
        assert [row.keys() for row in cut] == [row.keys() for row in whole]
        assert all(
            math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(cut, whole, strict=True) for k in a
        ), (table, cut, whole)
    boundaries = [
        json.loads((trained / "analysis" / n / "analysis.json").read_text())["result"]["boundaries"]
        for n in ("cut", "whole")
    ]
    assert boundaries[0] == boundaries[1]


def test_the_calibration_picks_the_smallest_localization_then_step_that_passes_everywhere():
    from analysis.calibrate_llc import pick, steps_none_pass

    row = lambda lr, gamma, step, passes: {"lr": lr, "localization": gamma, "step": step, "passes": passes}
    rows = [
        *(row(1e-3, 10.0, s, s != 60) for s in (0, 30, 60)),  # fails at its last step
        *(row(3e-3, 100.0, s, True) for s in (0, 30, 60)),
        *(row(1e-3, 100.0, s, True) for s in (0, 30, 60)),
        *(row(1e-4, 300.0, s, True) for s in (0, 30, 60)),
    ]
    assert pick(rows) == {"lr": 1e-3, "localization": 100.0}
    assert pick([r for r in rows if r["localization"] == 10.0]) is None
    # the initialisation, where nothing settles (λ̂ < 0), is named: the pick without it is the user's call
    unsettled_start = [{**r, "passes": r["passes"] and r["step"] != 0} for r in rows]
    assert pick(unsettled_start) is None and steps_none_pass(unsettled_start) == [0]
    assert steps_none_pass(rows) == [] and steps_none_pass([r for r in rows if r["localization"] == 10.0]) == [60]


def test_calibration_sweeps_step_size_and_localization_and_picks_one(trained):
    result = module(
        "analysis.calibrate_llc", trained, "--lr", "1e-3", "--localization", "100,300", "--steps", "0,30,60", *QUICK[:3]
    )
    out = trained / "analysis" / "llc_calibration"
    with open(out / "calibration.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 1 * 2 * 3 and (out / "traces.png").is_file()
    # its verdict is the table's: the smallest γ whose every step passes (12 draws may settle at none)
    passing = [g for g in ("100.0", "300.0") if all(r["passes"] == "True" for r in rows if r["localization"] == g)]
    if passing:
        assert result.returncode == 0 and f"llc_calibration: pick ε 0.001, γ {float(passing[0]):g}" in result.stdout
    else:
        assert result.returncode == 1 and "no setting passes" in result.stdout, result.stdout
    before = (out / "calibration.csv").read_bytes()
    again = module("analysis.calibrate_llc", trained, "--lr", "1e-3", *QUICK[:3])
    assert again.returncode == 2 and "--overwrite" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert (out / "calibration.csv").read_bytes() == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["stages.llc.lr=0"], "stages.llc.lr=0.0: must be > 0"),
        (["stages.llc.chains=0"], "stages.llc.chains=0"),
        (["tracker.measures=[subspace]"], "only stages.* options"),
        (["--steps", "0,1"], "at least 3 are needed"),
    ],
)
def test_bad_requests_are_one_line_before_any_work(trained, args, message):
    result = module("analysis.stages", trained, *args, "--name", "bad")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (trained / "analysis" / "bad").exists()


def test_without_the_llc_extra_asking_for_the_llc_is_one_line_naming_it(trained, monkeypatch, capsys):
    """devinterp made unimportable (None in sys.modules), as on an install without the extra."""
    from analysis.protocol import main
    from analysis.stages import Stages

    monkeypatch.setitem(sys.modules, "devinterp", None)
    assert main(Stages, [str(trained), "--name", "noextra"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: the local learning coefficient needs devinterp, the 'llc' extra: pip install -e '.[llc]'"
    )
    assert not (trained / "analysis" / "noextra").exists()
    assert main(Stages, [str(trained), "--name", "noextra", "stages.llc_enabled=false"]) == 0
    assert (
        "LLC" not in capsys.readouterr().out.splitlines()[0]
        and (trained / "analysis" / "noextra" / "essential_dynamics.png").is_file()
    )


def test_training_never_imports_devinterp():
    code = "import sys, train, runtime.build, analysis.rescore, reports.sweep_report; print('devinterp' in sys.modules)"
    result = warm_start.run([sys.executable, "-c", code], REPO, train_env(), timeout=120)  # devinterp: not the server's
    assert result.stdout.strip() == "False", result.stderr[-2000:]


def test_a_run_trained_before_the_finder_changed_is_still_analysed(trained):
    """Its config carries ``stages.window`` and ``stages.min_turn``, which this version retired:
    dropped on reading, and every section's overrides still checked as before."""
    from types import SimpleNamespace

    from analysis.saved_run import AnalysisError, run_config
    from records.trajectory import Trajectory

    config = Trajectory(trained).config
    config["stages"] |= {"window": 3, "min_turn": 0.1}
    old = SimpleNamespace(config=config)
    assert run_config(old, ["stages.alpha=0.05"], "stages", "stages.alpha=0.05").stages.alpha == 0.05
    rescored = run_config(old, ["tracker.measures=[subspace]"], "tracker", "tracker.measures=[subspace]")
    assert list(rescored.tracker.measures) == ["subspace"] and "window" not in rescored.stages
    with pytest.raises(AnalysisError, match="only tracker"):
        run_config(old, ["stages.alpha=0.05"], "tracker", "tracker.measures=[subspace]")


def test_an_empty_wandb_mode_is_one_line_before_any_measuring(trained, monkeypatch, capsys):
    """The analysis logs to W&B as the run did; W&B would refuse the variable after every step was measured."""
    from analysis.protocol import main
    from analysis.stages import Stages

    monkeypatch.setenv("WANDB_MODE", "")
    assert main(Stages, [str(trained), "stages.llc_enabled=false", "--name", "empty_mode"]) == 2
    assert capsys.readouterr().err.startswith("error: WANDB_MODE='' in the environment is not a W&B mode")
    assert not (trained / "analysis" / "empty_mode").exists()


def test_a_heads_and_a_layers_llc_are_devinterps_on_their_masks(trained):
    """Each head's and layer's weight-refined λ̂ in ``llc.csv`` (one batched SGLD run for all of them) against an
    independent estimate: devinterp's own ``sample`` with that group's mask (``llc_record``), on the weights the
    analysis read at its last step, the same sequences and SGLD settings. float32: they agree to the trace's
    own resolution, nβ · eps32 · L(w*), as in ``tests/metrics/test_refined_llc.py``."""
    from analysis.saved_run import run_config
    from conf.objects import llc_sequences, sgld_settings
    from metrics.dynamics.llc import llc_record
    from metrics.dynamics.refined_llc import group_masks
    from records.trajectory import Trajectory

    out = trained / "analysis" / "stages"
    if not (out / "llc.csv").is_file():  # the first test of this module writes it; alone, make it here
        assert module("analysis.stages", trained, *QUICK).returncode == 0
    with open(out / "llc.csv") as handle:
        last = list(csv.DictReader(handle))[-1]
    trajectory = Trajectory(trained)
    cfg = run_config(trajectory, QUICK, "stages")
    model = trajectory.model(int(float(last["step"])))
    settings = sgld_settings(cfg.stages.llc)
    for group in ("L1H0", "L0H1", "L1"):
        theirs = llc_record(
            model, llc_sequences(cfg), settings, cfg.stages.llc.settle_tolerance, group_masks(model, group)
        )
        resolution = settings.n_beta * torch.finfo(torch.float32).eps * theirs["init_loss"]
        assert float(last[f"llc_{group}"]) == pytest.approx(theirs["mean"], rel=1e-5, abs=resolution), group
    assert float(last["llc_L1H0"]) != float(last["llc_L0H1"])  # not one number logged for every head


def test_the_data_refined_llc_of_a_mixture_run_is_devinterps_on_the_components_sequences(tmp_path):
    """Wang et al.'s data-refined λ̂ (``stages.llc.data_refined``) of a run on a mixture of repeated tokens and
    chains: a head's λ̂ on the chains' held-out sequences against devinterp's ``sample`` with that head's mask
    on the same sequences (float32, to the trace's resolution), and not the one on the training mixture."""
    require_extra("devinterp", "llc")
    from analysis.saved_run import run_config
    from analysis.stages import component_sequences
    from conf.objects import sgld_settings
    from metrics.dynamics.llc import llc_record
    from metrics.dynamics.refined_llc import group_masks
    from records.trajectory import Trajectory

    run = tmp_path / "mixture"
    trained = run_train([*TINY, "data=mixture", "trainer.max_steps=30", NO_FIGURES], run)
    assert trained.returncode == 0, trained.stderr[-3000:]
    refined = [*QUICK, "stages.llc.draws=6", "stages.llc.burnin=2", "stages.llc.data_refined=[markov_icl]"]
    result = module("analysis.stages", run, *refined)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run / "analysis" / "stages" / "llc.csv") as handle:
        row = list(csv.DictReader(handle))[-1]  # step 30
    trajectory = Trajectory(run)
    cfg = run_config(trajectory, refined, "stages")
    settings, llc = sgld_settings(cfg.stages.llc), cfg.stages.llc
    rows = component_sequences(cfg, "markov_icl", llc.batches * llc.batch_size)
    model = trajectory.model(30)
    theirs = llc_record(model, rows, settings, llc.settle_tolerance, group_masks(model, "L1H0"))
    resolution = settings.n_beta * torch.finfo(torch.float32).eps * theirs["init_loss"]
    assert float(row["llc_on_markov_icl_L1H0"]) == pytest.approx(theirs["mean"], rel=1e-5, abs=resolution)
    assert float(row["llc_on_markov_icl_L1H0"]) != pytest.approx(float(row["llc_L1H0"]), rel=1e-3)
