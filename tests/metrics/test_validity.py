"""Agreement of a measure with the ablation: Spearman against a brute-force reference and known
values, the rank of the ground-truth pair, the 'first for good' step, and the writer- and
reader-level readings (heads summed over their partners) that redundant heads cannot flip."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from metrics.ground_truth.validity import (
    Agreement,
    agreement,
    agreements,
    average_ranks,
    first_step_ranked_first_for_good,
    head_agreement,
    head_totals,
    spearman,
)
from metrics.tracked.ground_truth import Validity

NAN = float("nan")


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


def pairs(n_layers: int, n_heads: int, values: dict) -> torch.Tensor:
    """A ``[L, H, L, H]`` float64 tensor, NaN except the ``{((l1, h1), (l2, h2)): value}`` given."""
    t = torch.full((n_layers, n_heads, n_layers, n_heads), NAN, dtype=torch.float64)
    for ((l1, h1), (l2, h2)), value in values.items():
        t[l1, h1, l2, h2] = value
    return t


def redundant_readers(circuit_score: float, others: tuple[float, float] = (0.100, 0.200)):
    """2 x 2: both layer-1 heads are induction heads reading the previous-token head L0H0, with
    effects 0.500 and 0.501; the measure scores the truth L0H0->L1H1 at ``circuit_score``, the
    other L0H0 pair at 0.800 and L0H1's two pairs at ``others``."""
    effects = pairs(
        2, 2, {((0, 0), (1, 0)): 0.500, ((0, 0), (1, 1)): 0.501, ((0, 1), (1, 0)): 0.020, ((0, 1), (1, 1)): 0.030}
    )
    scores = pairs(
        2,
        2,
        {
            ((0, 0), (1, 0)): 0.800,
            ((0, 0), (1, 1)): circuit_score,
            ((0, 1), (1, 0)): others[0],
            ((0, 1), (1, 1)): others[1],
        },
    )
    return scores, effects


def test_redundant_readers_flip_the_pair_rank_not_the_writer_rank():
    """The issue's case: a 0.002 change of one score moves the pair-level rank of truth from 2 to 1
    (and its Spearman from 0.8 to 1); the writer level reads L0H0 first either way."""
    below, above = agreement(*redundant_readers(0.799)), agreement(*redundant_readers(0.801))
    # pairs (L0H0->L1H0, L0H0->L1H1, L0H1->L1H0, L0H1->L1H1): score ranks (4, 3, 1, 2) / (3, 4, 1, 2), effect ranks (3, 4, 1, 2)
    assert (below.rank_of_truth, above.rank_of_truth) == (2, 1)
    assert below.spearman == pytest.approx(1 - 6 * 2 / (4 * 15)) and above.spearman == pytest.approx(1.0)
    # writers L0H0, L0H1 (layer-1 heads write to no later head): effects 1.001, 0.050; scores 1.599 | 1.601, 0.300
    for result in (below, above):
        assert result.writer == Agreement(rank_of_truth=1, spearman=pytest.approx(1.0))
    totals = head_totals(*redundant_readers(0.799), "writer")
    assert torch.allclose(totals[0], torch.tensor([1.599, 0.300], dtype=torch.float64))
    assert torch.allclose(totals[1], torch.tensor([1.001, 0.050], dtype=torch.float64))
    # readers L1H0, L1H1: effects 0.520, 0.531 (L1H1 the truth); scores 0.900, 0.999 | 1.001
    assert torch.allclose(
        head_totals(*redundant_readers(0.799), "reader")[1], torch.tensor([0.520, 0.531], dtype=torch.float64)
    )
    assert below.reader == above.reader == Agreement(rank_of_truth=1, spearman=pytest.approx(1.0))


def test_each_level_is_fragile_to_redundancy_on_its_own_side():
    """Two redundant readers are two near-equal readers. With L0H1 scoring both alike (0.200), the
    reader totals are 1.000 against 0.999 | 1.001 for effects 0.520 against 0.531: the same 0.002
    nudge flips the reader level, never the writer level. Swapping the writer and reader axes (two
    redundant writers feeding one reader) swaps the two levels exactly."""
    below, above = (agreement(*redundant_readers(c, others=(0.200, 0.200))) for c in (0.799, 0.801))
    assert (below.rank_of_truth, above.rank_of_truth) == (2, 1)
    assert (below.reader.rank_of_truth, above.reader.rank_of_truth) == (2, 1)
    assert (below.reader.spearman, above.reader.spearman) == (pytest.approx(-1.0), pytest.approx(1.0))
    assert below.writer == above.writer == Agreement(rank_of_truth=1, spearman=pytest.approx(1.0))
    for circuit_score in (0.799, 0.801):
        scores, effects = redundant_readers(circuit_score, others=(0.200, 0.200))
        swapped = scores.permute(2, 3, 0, 1), effects.permute(2, 3, 0, 1)
        assert head_agreement(*swapped, "reader") == head_agreement(scores, effects, "writer")
        assert head_agreement(*swapped, "writer") == head_agreement(scores, effects, "reader")


def test_head_levels_hand_computed_with_three_heads():
    """4 layers x 1 head, every pair scored: writers L0, L1, L2 and readers L1, L2, L3."""
    effects = pairs(
        4,
        1,
        {
            ((0, 0), (1, 0)): 0.1,
            ((0, 0), (2, 0)): 0.2,
            ((0, 0), (3, 0)): 0.0,
            ((1, 0), (2, 0)): 0.4,
            ((1, 0), (3, 0)): 0.3,
            ((2, 0), (3, 0)): 0.5,
        },
    )
    scores = pairs(
        4,
        1,
        {
            ((0, 0), (1, 0)): 0.5,
            ((0, 0), (2, 0)): 0.1,
            ((0, 0), (3, 0)): 0.3,
            ((1, 0), (2, 0)): 0.2,
            ((1, 0), (3, 0)): 0.2,
            ((2, 0), (3, 0)): 0.6,
        },
    )
    result = agreement(scores, effects)
    # writers: effects (0.3, 0.7, 0.5) ranks (1, 3, 2); scores (0.9, 0.4, 0.6) ranks (3, 1, 2); sum d^2 = 8
    s, e = head_totals(scores, effects, "writer")
    assert s.tolist() == pytest.approx([0.9, 0.4, 0.6]) and e.tolist() == pytest.approx([0.3, 0.7, 0.5])
    assert result.writer.rank_of_truth == 3  # the truth L1 has the lowest total score
    assert result.writer.spearman == pytest.approx(1 - 6 * 8 / (3 * 8)) == pytest.approx(-1.0)
    # readers: effects (0.1, 0.6, 0.8) ranks (1, 2, 3); scores (0.5, 0.3, 1.1) ranks (2, 1, 3); sum d^2 = 2
    s, e = head_totals(scores, effects, "reader")
    assert s.tolist() == pytest.approx([0.5, 0.3, 1.1]) and e.tolist() == pytest.approx([0.1, 0.6, 0.8])
    assert result.reader.rank_of_truth == 1
    assert result.reader.spearman == pytest.approx(1 - 6 * 2 / (3 * 8)) == pytest.approx(0.5)
    assert result.writer.writer is None and result.reader.reader is None  # head levels carry no levels


def test_head_levels_leave_out_masked_pairs_on_both_sides():
    """3 layers x 1 head with L0->L2 unscored by the measure: its effect (0.4) is left out of L0's
    and L2's totals too. Counted, it would make L0 the truth writer (0.7 > 0.5), ranked 2."""
    effects = pairs(3, 1, {((0, 0), (1, 0)): 0.3, ((0, 0), (2, 0)): 0.4, ((1, 0), (2, 0)): 0.5})
    scores = pairs(3, 1, {((0, 0), (1, 0)): 0.2, ((0, 0), (2, 0)): NAN, ((1, 0), (2, 0)): 0.6})
    s, e = head_totals(scores, effects, "writer")
    assert s.tolist() == pytest.approx([0.2, 0.6]) and e.tolist() == pytest.approx([0.3, 0.5])
    assert head_agreement(scores, effects, "writer") == Agreement(1, pytest.approx(1.0))
    s, e = head_totals(scores, effects, "reader")
    assert s.tolist() == pytest.approx([0.2, 0.6]) and e.tolist() == pytest.approx([0.3, 0.5])
    assert head_agreement(scores, effects, "reader").rank_of_truth == 1
    counted = head_agreement(scores.nan_to_num(0.0), effects, "writer")  # what counting it would give
    assert counted.rank_of_truth == 2
    one_writer = pairs(2, 1, {((0, 0), (1, 0)): 0.3})
    assert math.isnan(head_agreement(one_writer, one_writer, "writer").spearman)  # one head: undefined
    with pytest.raises(ValueError):
        head_agreement(pairs(2, 1, {}), pairs(2, 1, {}), "writer")
    with pytest.raises(ValueError):
        head_agreement(scores, effects, "pair")


def plain_head_agreement(scores, effects, level):
    """Plain Python over nested lists [L][H][L][H]: totals by loops, then rank of truth and the
    brute-force Spearman."""
    L, H = len(scores), len(scores[0])
    heads = [(l, h) for l in range(L) for h in range(H)]
    totals = []
    for head in heads:
        s_total = e_total = 0.0
        found = False
        for other in heads:
            w, r = (head, other) if level == "writer" else (other, head)
            s, e = scores[w[0]][w[1]][r[0]][r[1]], effects[w[0]][w[1]][r[0]][r[1]]
            if s == s and e == e:
                s_total, e_total, found = s_total + s, e_total + e, True
        if found:
            totals.append((s_total, e_total))
    s_totals, e_totals = [t[0] for t in totals], [t[1] for t in totals]
    truth = max(range(len(totals)), key=lambda i: (e_totals[i], -i))  # the first of the largest
    rank = 1 + sum(1 for v in s_totals if v > s_totals[truth])
    return rank, brute_force_spearman(s_totals, e_totals), s_totals, e_totals


@pytest.mark.parametrize("seed", range(6))
def test_head_levels_match_a_plain_python_reference(seed):
    """3 layers x 2 heads, random scores and effects on a coarse grid (ties), some pairs masked."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.arange(3)
    later = (layer[None, None, :, None] > layer[:, None, None, None]).expand(3, 2, 3, 2)
    scores = (torch.randint(0, 5, (3, 2, 3, 2), generator=g) / 4).double().masked_fill(~later, NAN)
    effects = (torch.randint(0, 7, (3, 2, 3, 2), generator=g) / 6).double().masked_fill(~later, NAN)
    scores[torch.rand(3, 2, 3, 2, generator=g) < 0.2] = NAN
    for level in ("writer", "reader"):
        rank, rho, s_ref, e_ref = plain_head_agreement(scores.tolist(), effects.tolist(), level)
        s, e = head_totals(scores, effects, level)
        assert s.tolist() == pytest.approx(s_ref, abs=1e-12) and e.tolist() == pytest.approx(e_ref, abs=1e-12)
        result = head_agreement(scores, effects, level)
        assert result.rank_of_truth == rank
        assert result.spearman == pytest.approx(rho, rel=1e-9) or (math.isnan(result.spearman) and math.isnan(rho))


def test_pair_level_is_unchanged_by_the_head_levels():
    """``agreement``'s pair fields are the pair-level reading alone; levels only for writer x reader axes."""
    scores, effects = redundant_readers(0.799)
    result = agreement(scores, effects)
    valid = ~scores.isnan()
    assert (result.rank_of_truth, result.spearman) == (2, spearman(scores[valid], effects[valid]))
    assert result.writer == head_agreement(scores, effects, "writer") and result.reader == head_agreement(
        scores, effects, "reader"
    )
    flat = agreement(scores[valid], effects[valid])  # one axis: no writer or reader to sum over
    assert (flat.rank_of_truth, flat.spearman, flat.writer, flat.reader) == (2, result.spearman, None, None)


def test_validity_keys_name_the_levels():
    levels = Agreement(2, 0.8, writer=Agreement(1, 1.0), reader=Agreement(1, NAN))
    validity = {
        "loss_change": {"frobenius": levels, "match": Agreement(3, 0.5)},
        "pattern_change": {"frobenius": levels},
    }
    outputs = Validity().outputs(validity, SimpleNamespace(circuit=None, step=0))
    assert {output.name: output.value for output in outputs} == {
        "validity/loss_change/frobenius/rank_of_truth": 2.0,
        "validity/loss_change/frobenius/spearman": 0.8,
        "validity/loss_change/frobenius/writer_rank_of_truth": 1.0,
        "validity/loss_change/frobenius/writer_spearman": 1.0,
        "validity/loss_change/frobenius/reader_rank_of_truth": 1.0,  # an undefined Spearman is left out
        "validity/loss_change/match/rank_of_truth": 3.0,
        "validity/loss_change/match/spearman": 0.5,  # no levels: no keys
        "validity/pattern_change/frobenius/rank_of_truth": 2.0,
        "validity/pattern_change/frobenius/spearman": 0.8,  # pairs only
    }


@pytest.mark.parametrize("seed", range(4))
def test_batched_agreements_equal_one_by_one(seed):
    """``agreements`` (batched over the measures, as a snapshot judges them) equals ``agreement``
    called per measure, ties and masked pairs included; a scorer with its own NaN mask falls back."""
    generator = torch.Generator().manual_seed(seed)
    shape = (3, 2, 3, 2)
    later = torch.zeros(shape, dtype=torch.bool)
    for l1 in range(3):
        later[l1, :, l1 + 1 :, :] = True
    masked = lambda t: t.masked_fill(~later, math.nan)
    effects = masked(torch.randn(shape, generator=generator, dtype=torch.float64))
    scorers = {f"m{i}": masked(torch.randn(shape, generator=generator, dtype=torch.float64)) for i in range(4)}
    scorers["ties"] = masked(torch.randint(0, 3, shape, generator=generator).double())
    scorers["truth"] = effects.clone()
    got = agreements(scorers, effects)
    assert got == {name: agreement(scores, effects) for name, scores in scorers.items()}
    assert got["truth"].rank_of_truth == 1 and got["truth"].spearman == pytest.approx(1.0)
    scorers["own mask"] = scorers["m0"].clone()
    scorers["own mask"][0, 0, 1, 0] = math.nan
    assert agreements(scorers, effects) == {name: agreement(scores, effects) for name, scores in scorers.items()}


def test_average_ranks_by_sorting_equal_the_pairwise_count():
    """Ranks by sorting (O(n) memory: the pairwise count took ~0.8 GB per measure at 12 × 12 heads)
    equal the definition, (values below) + (values equal, itself included, + 1) / 2, row by row, ties included."""
    generator = torch.Generator().manual_seed(0)
    for high in (3, 50, 10**6):
        values = torch.randint(0, high, (4, 60), generator=generator).double()
        below = (values[..., None, :] < values[..., :, None]).sum(-1)
        equal = (values[..., None, :] == values[..., :, None]).sum(-1)
        assert torch.equal(average_ranks(values), below.double() + (equal.double() + 1) / 2)
