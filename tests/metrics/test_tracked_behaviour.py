"""The ``behaviour`` quantity and the circuit pair it names, on a hand-built induction circuit
(tests.helpers.induction_circuit_model: L0H0 an exact previous-token head, L1H0 an exact induction
head, the two H1 heads near-uniform noise)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data.probe import ProbeBatch
from metrics.heads.behaviour import BUILT_IN_BEHAVIOURS as BEHAVIOURS
from metrics.heads.behaviour import type_names_of
from metrics.snapshot import measure
from metrics.tracked.base import tracked_quantities
from tests.helpers import PROBE, induction_circuit_model

TYPES = type_names_of(BEHAVIOURS)

QUANTITIES = ("behaviour", "circuit")


@dataclass
class HandTask:
    """What the quantities ask of a task: its name, reader behaviour and whether it has BOS (id 8 here)."""

    reader_behaviour: str
    bos: bool = True
    name: str = "hand"


def snapshot(probe: ProbeBatch, reader: str):
    found = tracked_quantities()
    quantities = [found[name]().for_task(HandTask(reader), n_random=8) for name in QUANTITIES]
    return measure(induction_circuit_model(), probe, quantities, dtype=torch.float64)


def test_the_hand_built_heads_are_typed_as_built_and_the_noise_heads_unspecialised():
    snap = snapshot(PROBE, "induction")
    reading = snap["behaviour"]
    assert [[TYPES[int(t)] for t in layer] for layer in reading.types] == [
        ["previous_token", "unspecialised"],
        ["induction", "unspecialised"],
    ]
    scores = reading.scores
    assert scores[0, 0, BEHAVIOURS.index("previous_token")] > 0.999
    assert scores[1, 0, BEHAVIOURS.index("induction")] > 0.999
    assert "statistical_induction" not in reading.behaviours  # the repeated probe reads prefix matching as induction
    assert snap["circuit"] == ((0, 0), (1, 0))


def test_on_chains_the_reader_is_the_top_statistical_induction_head():
    """Sequences of three states with repeats at no fixed offset: the pair's reader is the head with the
    top statistical-induction score, and the hand-built induction head is typed as one."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randint(0, 3, (6, 8), generator=generator)
    tokens = torch.cat([torch.full((6, 1), 8), states], dim=1)  # [BOS] + 8 chain tokens
    chains = ProbeBatch(tokens=tokens, n=4, first_start=1)
    snap = snapshot(chains, "statistical_induction")
    reading = snap["behaviour"]
    assert "statistical_induction" in reading.behaviours and "induction" not in reading.behaviours
    reader = reading.scores[1:, :, BEHAVIOURS.index("statistical_induction")]
    assert snap["circuit"][1] == (1, int(reader.flatten().argmax()))
    assert TYPES[int(reading.types[1, 0])] == "statistical_induction"
