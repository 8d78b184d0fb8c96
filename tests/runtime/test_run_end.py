"""The end of a run (:func:`runtime.job.training_outcome`): its explorer page, begun where the report
begins it (while the figures are drawn) or else at the end, is written once and said once, after W&B
has finished; a run that fails after the report began the page leaves the page whole and unsaid."""

from __future__ import annotations

import shutil

import pytest

from runtime.job import training_outcome


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    """A copy of the tiny run to write pages into (the shared run is only read)."""
    return shutil.copytree(
        tiny_run.run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("analysis", "explorer.html")
    )


@pytest.mark.parametrize("begun_by_the_report", [True, False])
def test_a_finished_runs_page_is_written_and_said_once(run_copy, capsys, begun_by_the_report):
    with training_outcome(run_copy, explorer=True) as page:
        if begun_by_the_report:
            page.start()  # as the report does, its figures forked
            thread = page.thread
            page.start()  # a second call begins nothing
            assert page.thread is thread
    assert not page.thread.is_alive()
    printed = capsys.readouterr().out
    assert printed.count("explorer: ") == 1 and f"{run_copy / 'explorer.html'} (" in printed, printed
    assert (run_copy / "explorer.html").stat().st_size > 100_000
    assert not list(run_copy.glob(".explorer.html.*"))  # written whole: no temporary left


def test_a_run_that_fails_after_its_report_began_the_page_leaves_it_whole_and_unsaid(run_copy, capsys):
    with pytest.raises(RuntimeError, match="the report failed"):
        with training_outcome(run_copy, explorer=True) as page:
            page.start()
            raise RuntimeError("the report failed")
    assert not page.thread.is_alive()  # waited for: not cut off by the interpreter's exit
    assert (run_copy / "explorer.html").is_file() and not list(run_copy.glob(".explorer.html.*"))
    assert "explorer:" not in capsys.readouterr().out  # the run failed: its page is not announced


def test_without_the_explorer_nothing_is_begun(run_copy):
    with training_outcome(run_copy, explorer=False) as page:
        assert page is None
    assert not (run_copy / "explorer.html").exists()
