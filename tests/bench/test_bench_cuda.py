"""bench.cuda, dry-run on the CPU (the CPU in the GPU's place): the script runs end to end, its CPU
float32 column reads float32 rounding, and its float64 column is the reference itself where float64
reaches; without a GPU the real run is refused in one line. The dry run times the default shape only
(``--shapes default``): the paper shape's snapshots and its write-side null on an empty cache took 24 of
the test's 25 CPU seconds, through the same lines with other sizes."""

from __future__ import annotations

import json

import pytest
import torch

from bench import cuda


def test_the_dry_run_compares_every_quantity_and_times_each_snapshot(tmp_path):
    out = tmp_path / "cuda.json"
    assert cuda.main(["--dry-run", "--steps", "30", "--repeats", "1", "--shapes", "default", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    errors = report["relative_error_against_cpu_float64"]
    assert {"frobenius/K", "share/K", "induction", "ablation/loss_change (attribution)"} <= set(errors)
    for name, by_run in errors.items():
        assert by_run["cpu float32"] == by_run["cuda float32"], name  # the same CPU run twice
        if name.startswith(("frobenius", "subspace")) or name in (
            "matching",
            "ov_copying",
            "successor",
        ):  # the weight side
            assert by_run["cuda float64"] == 0.0, name
    assert (
        max(errors["frobenius/K"].values()) < 1e-5
        and errors["ablation/loss_change (attribution)"]["cpu float32"] < 1e-4
    )
    assert set(report["snapshot_seconds"]) == {"default exact cpu", "default attribution cpu"}


def test_a_shape_it_does_not_know_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as refused:
        cuda.main(["--dry-run", "--shapes", "default", "giant"])
    assert refused.value.code == 2 and "invalid choice: 'giant'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only where there is no GPU")
def test_without_a_gpu_the_benchmark_is_refused_in_one_line(capsys):
    assert cuda.main(["--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == "error: no CUDA device visible to torch"
