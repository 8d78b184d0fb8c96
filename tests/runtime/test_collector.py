"""Python's garbage collector around a run's start-up (:mod:`runtime.collector`): off for a single
run's start-up, back on for training with the start-up's objects frozen out of its collections; a
sweep's process keeps it on."""

from __future__ import annotations

import gc

import pytest

from runtime.collector import pause_for_start_up, resume_for_training


@pytest.fixture
def collector_as_before():
    """The collector on and nothing frozen by the test, after it."""
    frozen = gc.get_freeze_count()
    yield
    gc.enable()
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()


def test_a_single_runs_start_up_pauses_the_collector_and_training_freezes_what_it_made(collector_as_before):
    frozen = gc.get_freeze_count()
    pause_for_start_up(["trainer.max_steps=1", "model.n_heads=4"])
    assert not gc.isenabled()
    start_up = [[index] for index in range(10_000)]  # objects the start-up made, which live as long as the run
    resume_for_training()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(start_up)  # out of every later collection
    resume_for_training()  # again: nothing more
    assert gc.isenabled()


@pytest.mark.parametrize("argv", [["-m", "seed=0,1"], ["--multirun", "seed=0,1"], ["hydra.mode=MULTIRUN"]])
def test_a_sweeps_process_keeps_the_collector_on_and_freezes_nothing(collector_as_before, argv):
    frozen = gc.get_freeze_count()
    pause_for_start_up(argv)
    assert gc.isenabled()
    resume_for_training()
    assert gc.get_freeze_count() == frozen
