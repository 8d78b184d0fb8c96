"""Loss views read the right token positions (hand-made per-token losses)."""

from __future__ import annotations

import pytest
import torch

from data.probe import ProbeBatch
from metrics.dynamics.loss_views import first_occurrence_loss, in_context_learning_score, repeated_loss, token_losses


def test_slices_pick_first_and_repeated_tokens():
    n, first = 3, 1  # BOS a b c a b c: losses index j predicts token j + 1
    losses = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0, 30.0]])
    probe = ProbeBatch(torch.zeros(1, 7, dtype=torch.long), n, first)
    assert first_occurrence_loss(losses, probe).item() == pytest.approx(2.0)  # a, b, c
    assert repeated_loss(losses, probe).item() == pytest.approx(25.0)  # b, c of the repeat


def test_without_bos_the_first_token_is_unscored():
    n = 3  # a b c a b c
    losses = torch.tensor([[2.0, 3.0, 10.0, 20.0, 30.0]])
    probe = ProbeBatch(torch.zeros(1, 6, dtype=torch.long), n, 0)
    assert first_occurrence_loss(losses, probe).item() == pytest.approx(2.5)
    assert repeated_loss(losses, probe).item() == pytest.approx(25.0)


def test_a_gap_between_the_copies_moves_the_repeated_positions():
    n, gap = 2, 3  # BOS a b x y z a b: the repeat's b is predicted at position 6
    losses = torch.tensor([[1.0, 2.0, 0.0, 0.0, 0.0, 7.0, 30.0]])
    probe = ProbeBatch(torch.zeros(1, 8, dtype=torch.long), n, 1, gap)
    assert probe.repeat_start == 6 and probe.period == 5
    assert first_occurrence_loss(losses, probe).item() == pytest.approx(1.5)
    assert repeated_loss(losses, probe).item() == pytest.approx(30.0)


def test_icl_score_is_late_minus_early():
    losses = torch.tensor([[4.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    assert in_context_learning_score(losses, 0.25).item() == pytest.approx(0.0 - 4.0)


def test_token_losses_match_cross_entropy():
    logits = torch.randn(2, 5, 7)
    tokens = torch.randint(0, 7, (2, 5))
    expected = -logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(token_losses(logits, tokens), expected)
