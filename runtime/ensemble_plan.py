"""Which jobs of a sweep train together as an ensemble, checked before anything is written.

Members of one ensemble share every tensor's shape and the trainer's loop: the model's shape, the
batch and sequence sizes, the steps and the trainer's settings (``COMPATIBILITY``). They may differ in
anything else: seed (initialisation and data), learning rate, weight decay, betas, warmup, gradient
clipping, the data's own options, the interventions during training, the tracker's, the trajectory's
and the LLC estimates' settings. A sweep whose jobs
differ in a shape, or in a key of ``hydra.launcher.split_by``, is split into groups, each trained as its
own ensemble (``hydra.launcher.n_jobs`` of them at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf

from records.ensemble_checkpoint import member_record
from records.layout import resume_checkpoint

COMPATIBILITY = (
    "model",
    "data.batch_size",
    "data.seq_len",
    "trainer.max_steps",
    "trainer.accelerator",
    "trainer.devices",
    "trainer.precision",
    "trainer.accumulate_grad_batches",
    "trainer.log_every_n_steps",
    "trainer.checkpoint_every_n_steps",
    "trainer.deterministic",
    "trainer.num_threads",
)
"""Config keys every member of one ensemble must share (``model``: each of its keys but ``init`` and ``init_std``)."""


class EnsembleError(ValueError):
    """A sweep that cannot be trained as an ensemble: the one-line reason."""


def compatibility(cfg: DictConfig, resume_step: int | None, split_by: tuple[str, ...] = ()) -> tuple:
    """The values of ``COMPATIBILITY`` and of ``split_by`` (``hydra.launcher.split_by``), and the step a
    resumed member continues from: jobs with equal keys train as one ensemble."""
    values = []
    for key in split_by:
        if OmegaConf.select(cfg, key, default=EnsembleError) is EnsembleError:
            raise EnsembleError(f"hydra.launcher.split_by names {key}, which the config does not have")
    for key in (*COMPATIBILITY, *split_by):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, DictConfig):
            value = {k: str(v) for k, v in value.items() if k not in ("init", "init_std")}
            value = tuple(sorted(value.items()))
        values.append((key, str(value) if not isinstance(value, tuple) else value))
    return (*values, ("resume step", resume_step))


def resume_step(cfg: DictConfig) -> int | None:
    """The step a resumed job continues from; None for a fresh job. Raises :class:`EnsembleError` when
    the checkpoint was not written by an ensemble (a single run continues alone)."""
    if cfg.resume is None:
        return None
    checkpoint = torch.load(resume_checkpoint(cfg.resume), map_location="cpu", weights_only=True, mmap=True)
    if member_record(checkpoint) is None:
        raise EnsembleError(
            f"resume={cfg.resume} was trained alone, not as an ensemble member: continue it without"
            " hydra/launcher=ensemble (python train.py resume=...)"
        )
    return int(checkpoint["global_step"])


@dataclass
class Group:
    """Jobs (their indices in the sweep) that train as one ensemble, and what they share."""

    key: tuple
    jobs: list[int] = field(default_factory=list)


def groups(keys: dict[int, tuple]) -> list[Group]:
    """The jobs ``{job: compatibility key}`` grouped by key, in the order their first job comes."""
    found: dict[tuple, Group] = {}
    for job, key in keys.items():
        found.setdefault(key, Group(key)).jobs.append(job)
    return list(found.values())


def split_line(found: list[Group]) -> str:
    """The one line that says a sweep was split, and by what."""
    differing = [name for i, (name, _) in enumerate(found[0].key) if len({group.key[i][1] for group in found}) > 1]
    jobs = " | ".join(",".join(map(str, g.jobs)) for g in found)
    return (
        f"ensemble: {sum(len(g.jobs) for g in found)} jobs in {len(found)} groups that differ in"
        f" {', '.join(differing)} (jobs {jobs}): one ensemble after another"
    )
