"""A one-off snapshot takes the quantities it is asked for: every one that runs at every snapshot,
each scheduled one named, none named False, and a name it does not know refused."""

from __future__ import annotations

import pytest

from data.probe import make_probe_batch
from metrics.snapshot import take_snapshot
from tests.helpers import random_model

EVERY_SNAPSHOT = {"loss_views", "behaviour", "circuit", "composition"}


def test_a_snapshot_takes_what_runs_at_every_snapshot_and_what_it_names():
    model, probe = random_model(n_layers=2, n_heads=2).eval(), make_probe_batch(0, 4, 8, 10)
    assert set(take_snapshot(model, probe).results) == EVERY_SNAPSHOT
    assert set(take_snapshot(model, probe, ablation=True).results) == EVERY_SNAPSHOT | {"ablation", "validity"}
    assert set(take_snapshot(model, probe, writes={"every_n_steps": 1}).results) == EVERY_SNAPSHOT | {"writes"}


def test_false_leaves_a_quantity_out_even_one_that_runs_at_every_snapshot():
    model, probe = random_model(n_layers=2, n_heads=2).eval(), make_probe_batch(0, 4, 8, 10)
    taken = take_snapshot(model, probe, composition=False, circuit=False, ablation=True, validity=False, writes=False)
    assert set(taken.results) == EVERY_SNAPSHOT - {"composition", "circuit"} | {"ablation"}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"head_scores": True}, r"unknown tracked quantities \['head_scores'\]"),
        ({"composition": {"measures": ["frobenious"]}}, r"composition: measures has unknown \['frobenious'\]"),
        ({"ablation": {"method": "guess"}}, r"ablation: method='guess' must be one of"),
        ({"behaviour": False}, r"circuit reads behaviour: leave it out too \(circuit=False\)"),
    ],
)
def test_a_bad_request_is_refused_before_any_work(options, message, monkeypatch):
    model, probe = random_model(n_layers=2, n_heads=2).eval(), make_probe_batch(0, 4, 8, 10)
    monkeypatch.setattr(type(model), "run_with_cache", lambda *a, **k: pytest.fail("the probe pass ran"))
    with pytest.raises(ValueError, match=message):
        take_snapshot(model, probe, **options)
