"""Signals around training: a time-limit warning outside training, and SLURM requeueing left to the runtime."""

from __future__ import annotations

import os
import signal

from lightning.pytorch.plugins.environments import SLURMEnvironment

from runtime.job import TIME_LIMIT_WARNINGS, time_limit_warnings_noted


def test_a_time_limit_warning_outside_training_is_noted_and_the_job_goes_on(capfd):
    before = {signum: signal.getsignal(signum) for signum in TIME_LIMIT_WARNINGS}
    with time_limit_warnings_noted():
        for signum in TIME_LIMIT_WARNINGS:
            os.kill(os.getpid(), signum)  # by default: the process ends here
    assert capfd.readouterr().err.splitlines() == [
        "SIGUSR1 received outside training: going on",
        "SIGUSR2 received outside training: going on",
    ]
    assert {signum: signal.getsignal(signum) for signum in TIME_LIMIT_WARNINGS} == before


def test_under_slurm_lightning_requeues_nothing_itself(tmp_path, monkeypatch):
    """Lightning's SLURM handler requeues on SIGUSR1 whenever it is installed, a finished job too; the
    runtime requeues instead (runtime/slurm.py), so the trainer's SLURM environment has it off."""
    from runtime.build import build_trainer
    from tests.helpers import composed

    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "train"}.items():
        monkeypatch.setenv(key, value)
    trainer = build_trainer(composed("logger=csv", "tracker.enabled=false"), tmp_path)
    environment = trainer._accelerator_connector.cluster_environment
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue is False
