"""The protocol every analysis of saved weights goes through (``analysis.protocol``), on one real
``train.py`` sweep: a small analysis defined here (a step's measurement and a conclusion, nothing
else) gets the command line, the cache, the outputs, W&B and the sweep report's columns; and the
product's analyses run over the same sweep as a user runs them."""

from __future__ import annotations

import csv
import json
import os
import signal
import time

import pytest
import torch

from analysis.protocol import Analysis, Conclusion, CtrlC, main
from metrics.dynamics.stages import Boundary
from records import wandb_records
from records.trajectory import Trajectory
from tests.helpers import WITH_WANDB, module, require_extra, run_tiny_sweep

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two seeds of the tiny run, W&B offline as a user's default."""
    directory = tmp_path_factory.mktemp("sweep") / "sweep"
    run_tiny_sweep(directory, "seed=0,1", WITH_WANDB)
    return directory


class OutputNorms(Analysis):
    """Every head's ‖W_O‖ (Frobenius) at each step; the step where their sum grew fastest."""

    kind = "output_norms"
    columns_title = "output norms (a test's analysis)"
    measured = 0  # steps measured, over every instance: the cache must spare a second reading

    def measure(self, step, model):
        OutputNorms.measured += 1
        norms = torch.stack([layer.W_O.detach().flatten(1).norm(dim=1) for layer in model.layers])  # [L, H]
        return {"total": float(norms.sum())}, {"norms": norms}

    def describe_row(self, row):
        return f"Σ‖W_O‖ {row['total']:.3f}"

    def conclude(self, rows, tensors):
        steps = torch.tensor([row["step"] for row in rows], dtype=torch.float64)
        totals = torch.stack([t["norms"].sum() for t in tensors]).double()
        growth = totals.diff() / steps.diff()
        fastest = float(steps[1:][growth.argmax()])
        return Conclusion(
            result={"fastest_growth_step": fastest},
            summary={"output_norms/fastest_growth_step": fastest},
            columns={"final_output_norm": float(totals[-1]), "fastest_growth_step": fastest},
        )


def reference_total(run_dir, step) -> float:
    """Σ over heads of ‖W_O‖ from the saved file itself, not through the model."""
    weights = Trajectory(run_dir).state_dict(step)
    return sum(float(w.flatten(1).norm(dim=1).sum()) for name, w in weights.items() if name.endswith("W_O"))


def test_an_analysis_written_in_one_class_gets_the_command_the_cache_w_and_b_and_the_sweep_report(sweep, capsys):
    assert main(OutputNorms, [str(sweep)]) == 0
    printed = capsys.readouterr().out
    jobs = [sweep / "0", sweep / "1"]
    assert OutputNorms.measured == sum(len(Trajectory(job).steps) for job in jobs)
    for job in jobs:
        out = job / "analysis" / "output_norms"
        record = json.loads((out / "analysis.json").read_text())
        assert record["steps"] == Trajectory(job).steps and not record["incomplete"]
        with open(out / "steps.csv") as handle:
            rows = list(csv.DictReader(handle))
        assert [int(r["step"]) for r in rows] == record["steps"]
        for row in rows:  # the numbers are the saved weights', computed independently
            assert float(row["total"]) == pytest.approx(reference_total(job, int(row["step"])), rel=1e-6)
        assert record["columns"]["final_output_norm"] == pytest.approx(reference_total(job, record["steps"][-1]))
        (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
        logged = [r for r in wandb_records.history(run_file) if "output_norms/total" in r]
        assert [r["trainer/global_step"] for r in logged] == record["steps"]  # training's step axis
        assert (
            wandb_records.summary(run_file)["output_norms/fastest_growth_step"]
            == record["result"]["fastest_growth_step"]
        )
    # the sweep report: the analysis's columns for each job, and their mean ± sd over the seeds
    with open(sweep / "analysis" / "output_norms" / "sweep_jobs.csv") as handle:
        table = list(csv.DictReader(handle))
    finals = [json.loads((j / "analysis/output_norms/analysis.json").read_text())["columns"] for j in jobs]
    assert [float(r["final_output_norm"]) for r in table] == pytest.approx([f["final_output_norm"] for f in finals])
    assert "output norms (a test's analysis):" in printed and "over seeds (all jobs): final_output_norm " in printed
    # the same command again: both jobs kept; --overwrite reads the cached steps without measuring
    measured = OutputNorms.measured
    assert main(OutputNorms, [str(sweep)]) == 0 and capsys.readouterr().out.count("kept: ") == 2
    assert main(OutputNorms, [str(sweep), "--overwrite"]) == 0
    assert OutputNorms.measured == measured and "are measured already" in capsys.readouterr().out


def test_its_bad_requests_are_one_line_before_any_work(sweep, capsys):
    assert main(OutputNorms, [str(sweep / "0"), "tracker.measures=[subspace]", "--name", "bad"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: 'tracker.measures=[subspace]': this analysis takes no config options (the weights are fixed)"
    )
    assert main(OutputNorms, [str(sweep / "0"), "--steps", "7", "--name", "bad"]) == 2
    assert "step 7 was not saved" in capsys.readouterr().err
    assert not (sweep / "0" / "analysis" / "bad").exists()


def test_a_sweeps_stages_reach_its_report(sweep):
    require_extra("devinterp", "llc")
    quick = ["stages.llc.chains=2", "stages.llc.draws=12", "stages.llc.burnin=4", "stages.llc.batches=2"]
    args = [*quick, "stages.sequences=8", "stages.llc.heads=false"]
    staged = module("analysis.stages", sweep, *args)
    assert staged.returncode == 0, staged.stderr[-3000:]
    assert "stage boundaries (step (90 % of resamples" in staged.stdout and "over seeds (all jobs)" in staged.stdout
    with open(sweep / "analysis" / "stages" / "sweep_jobs.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 and all(row["stage_boundaries"] for row in rows)
    expected = [json.loads((sweep / j / "analysis" / "stages" / "analysis.json").read_text()) for j in ("0", "1")]
    for row, record in zip(rows, expected, strict=True):
        boundaries = record["result"]["boundaries"]
        assert row["stage_boundaries"] == ("; ".join(Boundary(**p).describe() for p in boundaries) or "none")
    again = module("analysis.stages", sweep, *args)  # as after an interruption
    assert again.returncode == 0 and again.stdout.count("kept: ") == 2 and "stage boundaries" in again.stdout
    other = module("analysis.stages", sweep, *quick, "stages.sequences=8", "stages.llc.heads=true")  # another request
    assert other.returncode == 2 and "exists" in other.stderr


def test_a_sweep_is_rescored_job_by_job_then_reported(sweep):
    rescored = module("analysis.rescore", sweep, "tracker.ablation.kind=resample", "--name", "resample")
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    for job in ("0", "1"):
        assert (sweep / job / "analysis" / "resample" / "csv" / "metrics.csv").is_file()
    report = sweep / "analysis" / "resample"
    assert (report / "sweep_jobs.csv").is_file() and (report / "sweep_aligned.png").is_file()
    assert "sweep: 2 jobs" in rescored.stdout


class NativeCtrlC(OutputNorms):
    """Ctrl-C on the second step, landing inside a "native library" that turns it into another error
    (as safetensors' reader did in CI: a ``ValueError``)."""

    kind = "native_ctrl_c"

    def measure(self, step, model):
        if step != self.request.steps[0]:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler runs at the next bytecode
            except KeyboardInterrupt:
                raise ValueError(
                    "could not determine the shape of object type 'torch.storage.UntypedStorage'"
                ) from None
        return super().measure(step, model)


def test_a_ctrl_c_that_a_native_library_turned_into_another_error_still_stops_and_keeps_the_steps(sweep, capsys):
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a worker may have it ignored
    try:
        with pytest.raises(SystemExit) as stopped:
            main(NativeCtrlC, [str(sweep / "0")])
    finally:
        signal.signal(signal.SIGINT, before)
    assert stopped.value.code == 130
    assert "1 measured steps kept in" in capsys.readouterr().out
    assert not (sweep / "0" / "analysis" / "native_ctrl_c" / "analysis.json").exists()
    # without Ctrl-C the same error is a failure, not a stop
    ctrl_c = CtrlC()
    with pytest.raises(ValueError), ctrl_c.watched():
        raise ValueError("a real failure")
    assert not ctrl_c.came
