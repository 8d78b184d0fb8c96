"""Shared fixtures. Tests never touch the network: W&B runs offline into pytest's tmp_path."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from runtime.threads import bounded_spinning
from tests import warm_start

os.environ.update(bounded_spinning(os.environ))  # as train.py, before torch loads

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "").isdigit():
    # each pytest-xdist worker (and every train.py it starts) gets its share of the cores, at least one:
    # with torch's default of every core in each worker, small kernels wait on threads descheduled by
    # another worker (the suite took 478 s with it, 426 s without, on 2 cores and 2 workers)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
# random baselines and head-behaviour nulls are cached on disk: keep the tests' cache out of the user's home
os.environ.setdefault(
    "INDUCTION_TRACKER_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"induction-tracker-tests-{os.getuid()}")
)


def pytest_configure(config) -> None:
    """Under pytest-xdist the workers share one warm-start server for their process tests (tests/warm_start.py):
    the controller says where it listens, the first worker to need it starts it, the controller ends it."""
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        warm_start.share(tempfile.mkdtemp(prefix="warm-start-"))


def pytest_unconfigure(config) -> None:
    if not hasattr(config, "workerinput"):
        warm_start.stop_shared()


def pytest_collection_modifyitems(config, items) -> None:
    """The test files with the most slow tests (those that train, most through a subprocess) first, each
    file's tests in their own order: pytest-xdist hands a worker one file at a time in this order
    (``make test``: ``--dist loadfile --no-loadscope-reorder``), so the long files start early and the
    workers end together, rather than a worker starting a long file as the others run out of work."""
    file_of = lambda item: item.nodeid.split("::", 1)[0]
    slow, count = {}, {}
    for item in items:
        count[file_of(item)] = count.get(file_of(item), 0) + 1
        slow[file_of(item)] = slow.get(file_of(item), 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (-slow[file_of(item)], -count[file_of(item)]))  # stable: each file's order kept


@dataclass(frozen=True)
class FinishedRun:
    """A ``train.py`` run that has ended: its directory, exit code and what it printed."""

    run_dir: Path
    returncode: int
    stdout: str
    stderr: str


def trained_once(tmp_path_factory, worker_id: str, name: str, args: list[str]) -> FinishedRun:
    """``python train.py ARGS`` (in process: :func:`tests.helpers.run_train`) trained once for the whole suite: under pytest-xdist the first worker to
    ask trains it while the other waits on a file lock in the directory the workers share, then reads
    the same run. Its users write only under its ``analysis/``, each under a name of its own."""
    from tests.helpers import run_train

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    run_dir, ended = shared / name, shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not ended.is_file():
            result = run_train(args, run_dir)
            record = {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}
            ended.write_text(json.dumps(record))
    return FinishedRun(run_dir, **json.loads(ended.read_text()))


@pytest.fixture(scope="session")
def shipped_run(tmp_path_factory, worker_id) -> FinishedRun:
    """``python train.py`` as shipped: 1500 steps, the default tracker, its figures, W&B offline."""
    from tests.helpers import WITH_WANDB

    return trained_once(tmp_path_factory, worker_id, "shipped_run", ["figures=true", "explorer=true", WITH_WANDB])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, worker_id) -> FinishedRun:
    """The tiny run (:data:`tests.helpers.TINY`: 60 steps, weights kept at 0, 1, 4, 15, 30, 60) that
    the analyses' tests read; with its W&B run, which the analyses continue."""
    from tests.helpers import TINY, WITH_WANDB

    return trained_once(tmp_path_factory, worker_id, "tiny_run", [*TINY, WITH_WANDB])
