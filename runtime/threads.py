"""The torch threads a run uses: how they wait (:func:`bounded_spinning`), how many
(:func:`torch_threads`), and setting them (:func:`set_torch_threads`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from omegaconf import DictConfig

SPIN_COUNT = 10_000
"""Busy-wait iterations of an idle OpenMP thread before it sleeps (libgomp's ``GOMP_SPINCOUNT``;
its own default is 300,000, and 0 under ``OMP_WAIT_POLICY=PASSIVE``)."""


def bounded_spinning(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to ``environ`` before torch loads (``os.environ.update(bounded_spinning(os.environ))``)
    so that torch's OpenMP threads spin ``SPIN_COUNT`` times when they run out of work,
    then sleep, unless the environment already says how they wait (``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT``). Training a small model runs thousands of short parallel regions a second:
    threads that sleep at once (``PASSIVE``) are woken by a system call for each, threads that spin
    long keep the second core busy for nothing. Measured on the 2-core machine, 2026-11-28, the default
    run (``python train.py``, three interleaved runs each): 46.1 s with ``PASSIVE`` (the earlier
    default), 34.8 s with this; a QR of 144 ``[768, 64]`` matrices with two busy processes on the cores
    0.5-0.7 s against 1.3-1.5 s with ``PASSIVE`` (docs/operations.md, "Threads")."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def torch_threads(cfg: DictConfig, launcher: DictConfig | None) -> int | None:
    """Torch threads for this run: ``trainer.num_threads`` if set; in a SLURM job, its CPUs; in a
    job of a parallel local sweep (``hydra/launcher=joblib``), the cores divided among the jobs
    running at once, so that they do not oversubscribe the machine; else None (torch's default)."""
    if cfg.trainer.num_threads is not None:
        return cfg.trainer.num_threads
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(os.environ["SLURM_CPUS_PER_TASK"])
    if launcher is not None and "JoblibLauncher" in str(launcher.get("_target_", "")):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        n_jobs = int(launcher.n_jobs)
        running = cores + 1 + n_jobs if n_jobs < 0 else n_jobs  # joblib: -1 is every core, -2 all but one
        return max(1, cores // max(1, running))
    return None


def set_torch_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)`` unless torch already uses that many: with torch's MKL, any
    call, even to the count in force, turns MKL's dynamic threading off and slows every training step
    after it (7 % at 4 x 8 x 256 x 32 by ``python -m bench.threads``: docs/operations.md, "Threads")."""
    import torch

    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
