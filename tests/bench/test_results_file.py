"""A benchmark's ``--out``: a file no benchmark wrote is refused in one line before any work and left as it
was; what a benchmark wrote carries the mark, and a later run may write over it."""

from __future__ import annotations

import importlib
import json

import pytest

from bench.results_file import check_out, write_results

BENCHES = [
    "composition",
    "cuda",
    "interventions",
    "measuring_aside",
    "refined_llc",
    "run_end",
    "startup",
    "threads",
    "throughput",
    "tracker_wall",
    "worker_start",
]
"""Every ``python -m bench.NAME`` that writes its results to ``--out FILE``."""


@pytest.mark.parametrize("name", BENCHES)
def test_a_file_no_benchmark_wrote_is_refused_before_any_work_and_left_as_it_was(name, tmp_path, capsys):
    summary = tmp_path / "summary.json"
    summary.write_text('{"final/loss/repeated": 1.25}\n')  # a run's, say
    with pytest.raises(SystemExit) as refused:
        importlib.import_module(f"bench.{name}").main(["--out", str(summary)])
    message = str(refused.value.code)
    assert (
        message == f"error: --out {summary} exists and this command did not write it: name a new file (nothing written)"
    )
    assert summary.read_text() == '{"final/loss/repeated": 1.25}\n'
    assert capsys.readouterr().out == ""  # nothing measured, nothing printed


def test_what_a_benchmark_wrote_carries_its_mark_and_may_be_written_over(tmp_path):
    out = tmp_path / "results.json"
    check_out(out)  # a new file in an existing directory
    write_results(out, "cuda", {"steps": 30, "timing": {"default exact cpu": 0.03}})
    written = json.loads(out.read_text())
    assert written == {
        "kind": "induction-composition-tracker bench.cuda",
        "steps": 30,
        "timing": {"default exact cpu": 0.03},
    }
    check_out(out)  # its own results: written over by the next run
    for where, why in ((tmp_path, "is a directory"), (tmp_path / "no" / "results.json", "no directory")):
        with pytest.raises(SystemExit, match=why):
            check_out(where)


def test_the_device_bench_refuses_a_directory_holding_files_it_did_not_write(tmp_path, capsys):
    """``python -m bench.device --out DIR`` writes ``device.json``, ``device.log`` and ``cuda.json`` into DIR:
    one it did not write is refused in one line before any part runs, and DIR is left as it was."""
    from bench.device import foreign_output, main

    assert foreign_output(tmp_path / "new") is None and foreign_output(tmp_path) is None  # new, or empty
    for name, text in (("device.json", '{"mine": 1}\n'), ("device.log", "my notes\n"), ("cuda.json", "{}\n")):
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        (out / name).write_text(text)
        with pytest.raises(SystemExit) as refused:
            main(["--out", str(out), "--cpu"])
        assert str(refused.value.code) == (
            f"error: --out {out}: {out / name} exists and bench.device did not write it: name another directory"
            " (nothing written)"
        )
        assert [p.name for p in out.iterdir()] == [name] and (out / name).read_text() == text
    assert capsys.readouterr().out == ""  # no part started
    ours = tmp_path / "ours"
    ours.mkdir()
    write_results(ours / "device.json", "device", {"parts": {}})
    (ours / "device.log").write_text("bench.device --cpu\n")
    write_results(ours / "cuda.json", "cuda", {})
    assert foreign_output(ours) is None  # a later run writes over its own
    (tmp_path / "a_file").write_text("x")
    assert (
        foreign_output(tmp_path / "a_file")
        == f"--out {tmp_path / 'a_file'} is a file: name a directory (nothing written)"
    )


def test_a_device_run_whose_cuda_part_does_not_run_reports_no_earlier_runs_cuda_results(tmp_path):
    """A DIR that a previous ``bench.device`` run wrote holds its ``cuda.json``: a run whose cuda part never
    starts (no budget left) or fails reports no cuda results and leaves no cuda.json of the earlier run."""
    from bench.device import main

    write_results(tmp_path / "cuda.json", "cuda", {"steps": 30, "timing": {"default exact cpu": 0.03}})
    assert main(["--out", str(tmp_path), "--cpu", "--budget", "0", "--skip", "gemm,sizes,overhead,tracked"]) == 0
    device = json.loads((tmp_path / "device.json").read_text())
    assert "cuda" not in device and not (tmp_path / "cuda.json").exists()


def test_a_damaged_part_file_is_one_line_naming_it_and_its_results_are_left_out(tmp_path, capsys):
    from bench.device import part_results

    damaged = tmp_path / "cuda.json"
    damaged.write_text('{"kind": "induction-composition-tracker bench.cuda", "steps": 3')  # cut while written
    assert part_results(damaged) is None and part_results(tmp_path / "absent.json") is None
    (line,) = capsys.readouterr().out.splitlines()
    assert line == f"bench.device: {damaged} is damaged (JSONDecodeError): its results left out"
    write_results(damaged, "cuda", {"steps": 3})
    assert part_results(damaged)["steps"] == 3
