"""The torch threads a run uses: how many (:func:`torch_threads`), and setting them (:func:`set_torch_threads`)."""

from __future__ import annotations

import os

from omegaconf import DictConfig


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
