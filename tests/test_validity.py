"""Agreement of a measure with the ablation: Spearman against a brute-force reference and known
values, the rank of the ground-truth pair, and the 'first for good' step."""

from __future__ import annotations

import math

import pytest
import torch

from metrics.ground_truth.validity import agreement, average_ranks, first_step_ranked_first_for_good, spearman


def brute_force_spearman(x, y):
    """Textbook definition: ranks with ties averaged by counting, then Pearson's r, in plain Python."""
    def ranks(v):
        return [sum(1 for w in v if w < a) + (sum(1 for w in v if w == a) + 1) / 2 for a in v]
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def test_average_ranks_share_ties():
    assert average_ranks(torch.tensor([0.3, 0.1, 0.3, 0.9])).tolist() == [2.5, 1.0, 2.5, 4.0]


def test_spearman_known_values():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x**3) == pytest.approx(1.0)  # monotone, not linear
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(x, torch.tensor([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.8)  # 1 - 6·2/(4·15)
    assert math.isnan(spearman(x, torch.zeros(4)))  # undefined for a constant side


def test_spearman_matches_brute_force_with_ties():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randint(0, 4, (9,), generator=g).double()  # many ties
        y = torch.randint(0, 5, (9,), generator=g).double()
        if len(x.unique()) > 1 and len(y.unique()) > 1:
            assert spearman(x, y) == pytest.approx(brute_force_spearman(x.tolist(), y.tolist()), rel=1e-12)


def test_agreement_rank_of_truth_ignores_masked_pairs():
    nan = float("nan")
    scores = torch.tensor([[nan, 0.5], [0.9, 0.2]])
    effects = torch.tensor([[3.0, 1.0], [0.1, 2.0]])  # truth: the 0.2-scored pair (3.0 is masked by scores)
    result = agreement(scores, effects)
    assert result.rank_of_truth == 3  # 0.9 and 0.5 score above it
    assert result.spearman == pytest.approx(brute_force_spearman([0.5, 0.9, 0.2], [1.0, 0.1, 2.0]))
    assert agreement(effects.nan_to_num(0.0) * 2, effects.nan_to_num(0.0)).rank_of_truth == 1


@pytest.mark.parametrize(
    "ranks, expected",
    [
        ([3, 1, 2, 1, 1], 30.0),  # first at 10, lost at 20, first again from 30 on
        ([1, 1, 1, 1, 1], 0.0),
        ([1, 1, 1, 1, 2], None),  # not first at the end
        ([2, 1, float("nan"), 1, 1], 10.0),  # unmeasured steps are skipped
    ],
)
def test_first_step_ranked_first_for_good(ranks, expected):
    steps = torch.tensor([0.0, 10.0, 20.0, 30.0, 40.0])
    assert first_step_ranked_first_for_good(steps, torch.tensor(ranks, dtype=torch.float64)) == expected
