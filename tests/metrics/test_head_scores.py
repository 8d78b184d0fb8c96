"""The familiar head scores (previous-token, induction, duplicate-token), read through the behaviour registry,
on hand-made attention patterns with known values, and on the hand-built induction circuit run for real."""

from __future__ import annotations

import pytest
import torch

from data.probe import ProbeBatch
from metrics.heads.behaviour import behaviour_scores, behaviour_targets
from metrics.heads.circuit_pair import circuit_pair
from metrics.snapshot import take_snapshot
from tests.helpers import induction_circuit_model

N, START = 4, 1  # BOS, t1..t4, t1..t4
T = START + 2 * N
REPEAT = START + N
TOKENS = torch.tensor([[8, 0, 1, 2, 3, 0, 1, 2, 3]])  # distinct t1..t4: every target is the probe's own
BOS = 8


def score(pattern: torch.Tensor, behaviour: str) -> torch.Tensor:
    """Every head's score on ``behaviour``, ``[heads]``, of ``pattern [b, heads, T, T]`` on ``TOKENS``."""
    tokens = TOKENS.expand(pattern.shape[0], -1)
    return behaviour_scores(pattern.double(), behaviour_targets(tokens, BOS, [behaviour]))[..., 0]


previous_token_score = lambda pattern: score(pattern, "previous_token")
induction_score = lambda pattern: score(pattern, "induction")
duplicate_token_score = lambda pattern: score(pattern, "duplicate_token")


def one_hot_pattern(target_of_query) -> torch.Tensor:
    """``[1, 1, T, T]`` attention with query q fully on ``target_of_query(q)``."""
    pattern = torch.zeros(1, 1, T, T)
    for q in range(T):
        pattern[0, 0, q, target_of_query(q)] = 1.0
    return pattern


def test_perfect_previous_token_head():
    pattern = one_hot_pattern(lambda q: max(q - 1, 0))
    assert previous_token_score(pattern).item() == 1.0
    assert induction_score(pattern).item() == 0.0


def test_perfect_induction_head():
    pattern = one_hot_pattern(lambda q: q - N + 1 if q >= REPEAT else 0)
    assert induction_score(pattern).item() == 1.0
    assert duplicate_token_score(pattern).item() == 0.0
    assert previous_token_score(pattern).item() == pytest.approx(1 / (T - 1))  # only q = 1 -> 0 counts


def test_perfect_duplicate_token_head():
    pattern = one_hot_pattern(lambda q: q - N if q >= REPEAT else 0)
    assert duplicate_token_score(pattern).item() == 1.0
    assert induction_score(pattern).item() == 0.0


def test_uniform_causal_attention_has_known_scores():
    pattern = torch.tril(torch.ones(T, T))
    pattern = (pattern / pattern.sum(-1, keepdim=True))[None, None]
    expected = sum(1 / (q + 1) for q in range(REPEAT, REPEAT + N)) / N
    assert induction_score(pattern).item() == pytest.approx(expected)
    assert previous_token_score(pattern).item() == pytest.approx(sum(1 / (q + 1) for q in range(1, T)) / (T - 1))


def test_scores_average_over_batch_and_keep_heads_apart():
    a = one_hot_pattern(lambda q: max(q - 1, 0))
    b = one_hot_pattern(lambda q: q)
    two_heads = torch.cat([a, b], dim=1)  # (1, 2, T, T)
    batch = torch.cat([two_heads, torch.cat([b, b], dim=1)], dim=0)  # (2, 2, T, T)
    torch.testing.assert_close(previous_token_score(batch), torch.tensor([0.5, 0.0], dtype=torch.float64))


def test_hand_built_circuit_runs_as_induction():
    """The hand-built weights really do induction, and the tracker finds the pair."""
    model = induction_circuit_model()  # d_vocab 9: tokens 0..7 random, 8 = BOS
    tokens = torch.tensor([[8, 0, 1, 2, 3, 0, 1, 2, 3], [8, 5, 7, 6, 4, 5, 7, 6, 4]])
    snap = take_snapshot(
        model, ProbeBatch(tokens=tokens, n=N, first_start=START), composition={"baseline_samples": 200}
    )
    behaviour = snap["behaviour"]
    assert behaviour.score("previous_token")[0, 0] > 0.95
    assert behaviour.score("induction")[1, 0] > 0.95
    assert behaviour.score("induction")[1, 1] < 0.5
    assert snap["loss_views"].repeated < 0.01
    assert snap["loss_views"].first_occurrence > 1.0
    assert snap.circuit == ((0, 0), (1, 0))


def test_circuit_pair_picks_top_previous_token_writer_before_top_induction_reader():
    previous = torch.tensor([[0.1, 0.9, 0.2], [0.95, 0.1, 0.1], [0.0, 0.0, 0.0]])
    induction = torch.tensor([[0.99, 0.0, 0.0], [0.1, 0.2, 0.3], [0.1, 0.8, 0.1]])
    # layer-0 induction is never a reader; the writer must come before the reader's layer
    assert circuit_pair(previous, induction) == ((1, 0), (2, 1))
    with pytest.raises(ValueError):
        circuit_pair(previous[:1], induction[:1])
