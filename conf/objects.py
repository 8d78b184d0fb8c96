"""The objects a config describes, built from it: the task, the model's shape, the interventions, the
probe, the tracked quantities, the LLC's and the stage finder's settings. Light (no Lightning, no
W&B), so the checks use it before anything heavy loads; ``runtime/build.py`` builds the run from these.

One helper, :func:`from_config`, turns a config node into the dataclass that owns its values; every
option's default and check live in that dataclass.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from data.probe import ProbeBatch
from data.task import Task, TokenSampler, tasks
from metrics.composition.measures import MEASURES
from metrics.dynamics.llc import SGLDSettings
from metrics.dynamics.stages import StageSettings
from metrics.tracked.base import TrackedQuantity, tracked_quantities, with_companions
from metrics.tracked.options import TrackerOptions
from models.interventions import Intervention, event_steps, plan_of
from models.transformer import TransformerShape


def from_config(cls, node, **values):
    """An instance of dataclass ``cls`` from the config ``node``'s values of its fields (``values``
    given here win; a nested dataclass from its own node): how every object the config describes is
    built, so a new option of ``cls`` needs no edit here. A key ``cls`` does not have is left out (an
    earlier version's, in a saved run's config); enums become their values."""
    given = OmegaConf.to_container(node, resolve=True, enum_to_str=True) if OmegaConf.is_config(node) else dict(node)
    types = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name in given and f.name not in values:
            value = given[f.name]
            nested = types.get(f.name)
            is_node = dataclasses.is_dataclass(nested) and isinstance(value, dict)
            kwargs[f.name] = from_config(nested, value) if is_node else value
    return cls(**kwargs, **values)


def task_of(cfg: DictConfig) -> Task:
    """The run's task (``cfg.data``; :mod:`data.task`), from a composed config or a saved run's."""
    found = tasks()
    if cfg.data.name not in found:
        raise ValueError(f"data.name={cfg.data.name!r}: no such task; choose one of {', '.join(found)}")
    return from_config(found[cfg.data.name], cfg.data)


def n_random(cfg: DictConfig) -> int:
    """The task's own tokens: the model's vocabulary less BOS."""
    return cfg.model.d_vocab - int(cfg.data.bos)


def build_sampler(cfg: DictConfig) -> TokenSampler:
    """The run's data generator, as a sample-ids -> tokens function."""
    return task_of(cfg).sampler(n_random(cfg))


def model_shape(cfg: DictConfig) -> TransformerShape:
    """The model's shape from ``cfg.model``."""
    return from_config(TransformerShape, cfg.model)


def intervention_plan(cfg: DictConfig) -> list[Intervention]:
    """The run's interventions, from its config's ``intervention`` (none where the config has none)."""
    node = OmegaConf.select(cfg, "intervention")
    return plan_of(None if node is None else OmegaConf.to_container(node, resolve=True, enum_to_str=True))


def trajectory_events(cfg: DictConfig) -> tuple[int, ...]:
    """The steps the weight trajectory keeps around each intervention's window edges
    (:func:`models.interventions.event_steps`, at the tracker's period)."""
    every = cfg.tracker.every_n_steps if cfg.tracker.enabled else TrackerOptions.every_n_steps
    return event_steps(intervention_plan(cfg), cfg.trainer.max_steps, max(every, 1))


def build_probe(cfg: DictConfig) -> ProbeBatch:
    """The tracker's probe batch, the task's (also what chooses an intervention's heads by score): its
    ``probe_batch_size`` sequences, or with ``probe_positions`` as many as hold that many repeated positions."""
    tracker, task = cfg.tracker, task_of(cfg)
    n = tracker.probe_n if tracker.probe_n is not None else task.probe_block()
    positions = OmegaConf.select(tracker, "probe_positions")  # absent from a config written before it
    sequences = tracker.probe_batch_size if positions is None else -(-positions // n)
    return task.probe(tracker.probe_seed, sequences, n, n_random(cfg))


def quantity_options(tracker: DictConfig) -> dict:
    """Every tracked quantity's and measure's options by name, built from the ``tracker`` section
    (the composition's from its root, each other's from ``tracker.NAME``)."""
    options = {}
    for name, owner in [*tracked_quantities().items(), *MEASURES.items()]:
        Options = getattr(owner, "Options", None)
        root = getattr(owner, "root_options", False)
        if Options is not None and (root or name in tracker):
            options[name] = from_config(Options, tracker if root else tracker[name])
    return options


def build_quantities(tracker: DictConfig, cfg: DictConfig | None = None) -> list[TrackedQuantity]:
    """Every tracked quantity the ``tracker`` section turns on (:mod:`metrics.tracked`), in the order
    they run; one that runs with another (validity with the ablation) while that one is on. With the
    run's config ``cfg``, each is readied for its task (:meth:`~metrics.tracked.base.TrackedQuantity.for_task`)."""
    options = quantity_options(tracker)
    built = [quantity.from_options(options) for quantity in tracked_quantities().values()]
    if cfg is not None:
        task, tokens = task_of(cfg), n_random(cfg)
        built = [quantity.for_task(task, tokens) for quantity in built]
    on = with_companions(
        built, {q.name for q in built if q.enabled and (q.every_n_steps is not None or not q.runs_with)}
    )
    return [q for q in built if q.name in on]


HELD_OUT_IDS = 10**12
"""First sample id of the held-out sequences: the training stream draws ids from 0 upward, so these
are never trained on (the generators are counter-based: any id is a fresh sample)."""


def held_out_sequences(cfg: DictConfig, count: int, offset: int = 0) -> torch.Tensor:
    """``[count, seq_len]`` token sequences of the run's training distribution that it never trained on."""
    return build_sampler(cfg)(np.arange(HELD_OUT_IDS + offset, HELD_OUT_IDS + offset + count))


def llc_sequences(cfg: DictConfig) -> torch.Tensor:
    """The held-out sequences SGLD samples the LLC's loss on: ``stages.llc.batches × batch_size``."""
    llc = cfg.stages.llc
    return held_out_sequences(cfg, llc.batches * llc.batch_size)


def n_beta_of(llc: DictConfig) -> float:
    """nβ: the configured value, or devinterp's ``default_nbeta``: batch_size / ln(batch_size)."""
    return float(llc.n_beta) if llc.n_beta is not None else llc.batch_size / math.log(llc.batch_size)


def stage_settings(stages: DictConfig) -> StageSettings:
    """How stage boundaries are read, from ``stages`` (its LLC seed seeds the resamples)."""
    return from_config(StageSettings, stages, seed=stages.llc.seed)


def sgld_settings(llc: DictConfig) -> SGLDSettings:
    """The SGLD settings of one LLC estimate, from ``stages.llc`` (nβ: :func:`n_beta_of`)."""
    return from_config(SGLDSettings, llc, n_beta=n_beta_of(llc))
