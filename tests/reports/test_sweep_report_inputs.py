"""The sweep report on what is not a sweep (no runs at all, or a W&B run file W&B cannot read: one line
of error and exit 1, nothing written) and on a sweep with one damaged file (one line naming it, the rest
reported)."""

from __future__ import annotations

import shutil

import pytest

from reports.sweep_report import main


def test_no_runs_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no run directories") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_wandb_run_file_is_one_line(tmp_path, capsys):
    run_dir = tmp_path / "wandb" / "offline-run-20261126_000000-abc123"
    run_dir.mkdir(parents=True)
    (run_dir / "run-abc123.wandb").write_bytes(b"not a W&B run file\n")
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "run-abc123.wandb is not a readable W&B run file" in err
    assert err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wandb"]


def cut_in_half(data: bytes, lines: bool) -> bytes:
    """``data`` cut at its middle; for a file of lines (YAML, CSV), inside the first word of the line
    there: cut at a line's end or inside a value, such a file is as valid as a shorter one (``a: 3``
    cut from ``a: 32``), which no reader can tell apart; a word cut short is a line no reader takes."""
    if not lines:
        return data[: len(data) // 2]
    line = data.rfind(b"\n", 0, len(data) // 2) + 1
    word = len(data) - len(data[line:].lstrip(b" -"))
    return data[: word + 2]


@pytest.mark.parametrize("damaged", ["summary.json", "csv/metrics.csv", ".hydra/config.yaml", "tensors/index.json"])
def test_a_damaged_file_of_one_job_is_one_line_naming_it_and_the_rest_is_reported(tiny_run, tmp_path, capsys, damaged):
    """A real run copied twice as a sweep; one file of job 0 cut in half: one line names it, both jobs are
    in the table, and no file of either run is touched."""
    for job in ("0", "1"):
        shutil.copytree(tiny_run.run_dir, tmp_path / job, ignore=shutil.ignore_patterns("wandb", "analysis*"))
    path = tmp_path / "0" / damaged
    path.write_bytes(cut_in_half(path.read_bytes(), lines=damaged.endswith((".yaml", ".csv"))))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(str(path if damaged != "tensors/index.json" else path.parent))
    said = "its last row is cut short; read without it" if damaged.endswith(".csv") else "damaged"
    assert said in lines[0] and "Traceback" not in err
    rows = (tmp_path / "sweep_jobs.csv").read_text().splitlines()
    assert len(rows) == 3  # the header and both jobs
    assert all(p.read_bytes() == data for p, data in before.items())
