"""Every task's integer options, at small and edge values: whatever the validation lets through, the
task's sampler, the tracker's probe, its strategies and a first snapshot (the ablation ground truth
included) can be built and measured on; what they cannot, the validation refuses, in one line each,
before any run starts (issue: a task option out of range once crashed after the W&B run existed)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from callbacks.tracker import tracker_from_config
from conf.objects import build_sampler, model_shape
from conf.validate import config_problems
from data.task import tasks
from models.transformer import AttentionOnlyTransformer
from tests.helpers import composed

VALUES = (0, 1, 2, 3, 4, 5, 7, 9, 17)
CHEAP = [  # the probe at 8 sequences: its random nulls cost an eighth of the default 64 on the first build
    "tracker.probe_batch_size=8",
    "tracker.baseline_samples=20",
    "tracker.measures=[frobenius]",
    "tracker.dense_measures=[frobenius]",
]


def options():
    for name, task in sorted(tasks().items()):
        base = [f"data={name}"] + (["experiment=markov_icl"] if name == "markov_icl" else [])
        for field in dataclasses.fields(task):
            if field.type in ("int", int) and field.name not in ("batch_size", "seed"):
                yield base, field.name


@pytest.mark.parametrize("strategies", ["strategies on", "strategies off"])
@pytest.mark.parametrize("base, option", list(options()), ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_the_smallest_values_the_validation_lets_through_can_be_trained_and_measured_on(base, option, strategies):
    """Each value is validated; the two smallest it accepts (the edge, where a generator or the strategies
    run out of room) are built and measured on, with the strategies tracked and without (their own check
    refuses short sequences first)."""
    accepted = []
    off = ["tracker.strategies.every_n_steps=0"] if strategies == "strategies off" else []
    composed_once = composed(*base, *CHEAP, *off)  # each value set on a copy: what the override would compose to
    for value in VALUES:
        cfg = copy.deepcopy(composed_once)
        cfg.data[option] = value
        problems = config_problems(cfg)
        assert all("\n" not in p for p in problems)
        if not problems:
            accepted.append(cfg)
    for cfg in accepted[:2]:
        build_sampler(cfg)(list(range(2)))
        model = AttentionOnlyTransformer(model_shape(cfg))
        tracker = tracker_from_config(cfg, None)
        tracker.open(model, 0)
        tracker.measure([], model, 0, last=True)
