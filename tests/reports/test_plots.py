"""The report's figures drawn side by side (:func:`reports.plots.draw_figures`): forked children, as a
finished run draws them (its OpenMP team started), all forked before the tables (and the explorer
page) are written meanwhile."""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from PIL import Image

from metrics.dynamics.phase_change import smooth
from reports.plots import draw_figures, usable_cores
from tests.helpers import wait_for


def line_figure(values):
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot(values)
    return fig


def children() -> set[int]:
    """This process's child processes (Linux's ``/proc``)."""
    found = set()
    for entry in os.scandir("/proc"):
        try:
            stat = Path(entry.path, "stat").read_text() if entry.name.isdigit() else ""
        except OSError:  # gone meanwhile
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found.add(int(entry.name))
    return found


@pytest.fixture
def bounded():
    """Fail, not hang, should a child wait for threads it does not have (60 s); and leave no child behind
    (a hung one keeps pytest's output open)."""

    def too_long(signum, frame):
        raise TimeoutError("a figure's child never finished")

    before = children()
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
    for pid in children() - before:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_every_figure_is_drawn_even_one_that_runs_torch_after_the_parent_did(tmp_path, bounded):
    torch.ones(256, 256) @ torch.ones(256, 256)  # the parent's OpenMP team, as after training
    series = torch.linspace(0, 1, 50, dtype=torch.float64)
    drawings = [
        (lambda: line_figure(smooth(series, 5).numpy()), tmp_path / "smoothed.png"),  # conv1d in the child
        *((lambda i=i: line_figure([0, i]), tmp_path / f"line{i}.png") for i in range(3)),
    ]
    written = []
    parent = os.getpid()
    draw_figures(drawings, then=lambda: written.append(os.getpid()))
    assert written == [parent]  # the tables: once, here
    for _, path in drawings:
        with Image.open(path) as image:
            assert image.size == (220, 165)  # 2 x 1.5 inches at the report's 110 dpi


def test_a_figure_that_cannot_be_drawn_fails_here_not_silently(tmp_path, bounded):
    def broken():
        raise ValueError("no data for this figure")

    with pytest.raises(ValueError, match="no data for this figure"):
        draw_figures([(broken, tmp_path / "broken.png"), (lambda: line_figure([0, 1]), tmp_path / "fine.png")])
    assert not (tmp_path / "broken.png").exists()


@pytest.mark.skipif(usable_cores() < 2, reason="one core: the figures are drawn here, one after the other")
def test_every_figure_is_forked_before_then_runs_so_no_fork_follows_a_thread_it_starts(tmp_path, bounded):
    """``then`` may start a thread (the run's explorer page): forking after that would copy a process
    whose other thread may hold a lock. Each figure's child waits until ``then`` has seen every child
    started; a figure forked only after ``then`` had returned would never be seen by it."""
    started, go = tmp_path / "started", tmp_path / "go"
    started.mkdir()

    def waiting_figure(i: int):
        (started / str(i)).touch()
        wait_for(go.exists, 30, "then() to let the figures go")
        return line_figure([0, i])

    drawings = [(partial(waiting_figure, i), tmp_path / f"figure{i}.png") for i in range(5)]  # more than the cores

    def then() -> None:
        wait_for(lambda: len(list(started.iterdir())) == len(drawings), 30, "every figure's child to start")
        go.touch()

    draw_figures(drawings, then=then)
    assert all(path.is_file() for _, path in drawings)
