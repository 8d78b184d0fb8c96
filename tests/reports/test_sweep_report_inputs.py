"""The sweep report on what is not a sweep: no runs at all, or a W&B run file W&B cannot read, is one
line of error and exit 1, nothing written."""

from __future__ import annotations

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
