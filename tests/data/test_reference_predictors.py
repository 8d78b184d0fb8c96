"""The reference predictors against counts written out by hand, the in-context Markov chains against
their definition, and the strategies' Monte-Carlo KL against Edelman et al.'s published values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.strategy_nulls import PUBLISHED, monte_carlo_lines
from data import reference_predictors
from data.task import tasks
from data.tasks.markov_icl import MarkovICL, context_chain, sample_chains


def test_add_one_unigram_and_bigram_equal_hand_counts():
    tokens = torch.tensor([[0, 1, 1, 0, 1]])  # k = 2
    unigram = reference_predictors.unigram(tokens, 2)[0]
    bigram = reference_predictors.ngram(tokens, 2, 1)[0]
    # after 0 1 1 0 1: counts 0:2, 1:3 -> (2+1, 3+1) / 7
    assert unigram[4].tolist() == pytest.approx([3 / 7, 4 / 7])
    # the current token is 1; earlier 1s were followed by 1 (at 1->2) and 0 (at 2->3): (1+1, 1+1) / 4
    assert bigram[4].tolist() == pytest.approx([0.5, 0.5])
    # at position 3 (token 0, context 0 1 1 0): the earlier 0 was followed by 1 -> (0+1, 1+1) / 3
    assert bigram[3].tolist() == pytest.approx([1 / 3, 2 / 3])
    # at position 0: nothing counted yet -> uniform
    assert bigram[0].tolist() == pytest.approx([0.5, 0.5])
    assert unigram[0].tolist() == pytest.approx([2 / 3, 1 / 3])


def test_trigram_counts_the_two_token_context():
    tokens = torch.tensor([[2, 0, 1, 2, 0, 2, 0]])  # k = 3; last context (2, 0) was followed by 1 and by 2
    trigram = reference_predictors.ngram(tokens, 3, 2)[0]
    assert trigram[6].tolist() == pytest.approx([1 / 5, 2 / 5, 2 / 5])
    assert trigram[0].tolist() == pytest.approx([1 / 3] * 3)  # fewer than two tokens: no context


def test_copy_and_induction_by_hand():
    tokens = torch.tensor([[9, 3, 5, 3, 7]])  # n_random = 9: id 9 is BOS
    copy = reference_predictors.copy(tokens, 9)[0]
    assert copy[0].tolist() == pytest.approx([1 / 9] * 9)  # only BOS so far: uniform
    assert copy[3, 3] == pytest.approx(0.5) and copy[3, 5] == pytest.approx(0.5) and copy[3].sum() == pytest.approx(1)
    induction = reference_predictors.induction(tokens, 9)[0]
    assert induction[3].tolist() == pytest.approx([0, 0, 0, 0, 0, 1, 0, 0, 0])  # 3 was followed by 5
    assert induction[2].tolist() == pytest.approx([1 / 9] * 9)  # 5 not seen before: the fallback


def test_longest_match_induction_by_hand():
    tokens = torch.tensor([[9, 1, 2, 3, 5, 2, 7, 1, 2, 4, 1]])  # n_random = 9: id 9 is BOS
    longest = reference_predictors.longest_match(tokens, 9)[0]
    latest = reference_predictors.induction(tokens, 9)[0]
    # at 8 the context ends 1 2, as at 2 (followed by 3); the latest 2 alone, at 5, was followed by 7
    assert longest[8].tolist() == pytest.approx([0, 0, 0, 1, 0, 0, 0, 0, 0])
    assert latest[8].tolist() == pytest.approx([0, 0, 0, 0, 0, 0, 0, 1, 0])
    assert longest[5].tolist() == pytest.approx([0, 0, 0, 1, 0, 0, 0, 0, 0])  # one earlier 2: as induction
    # at 10 the 1s at 1 and 7 agree for one token each (BOS 1, 7 1 against 4 1): uniform over their followers
    assert longest[10].tolist() == pytest.approx([0, 0, 1, 0, 0, 0, 0, 0, 0])
    mixed = reference_predictors.longest_match(torch.tensor([[1, 2, 5, 1, 3, 0, 1]]), 9)[0]
    assert mixed[6].tolist() == pytest.approx([0, 0, 0.5, 0.5, 0, 0, 0, 0, 0])  # 1 followed by 2, then by 3
    assert longest[4].tolist() == pytest.approx([1 / 9] * 9)  # 5 not seen before: the fallback


def test_repeated_copy_strategy_has_loss_ln_n_on_the_repeats():
    task = tasks()["repeated"](n_min=6, n_max=6, seq_len=25)
    reference = task.reference(np.arange(20), 64)
    tokens, copy, positions = reference.tokens, reference.strategies["copy"], reference.positions
    assert positions.tolist() == list(range(7, 24))  # every position whose next token is a repeat (from t_2 on)
    for row in range(len(tokens)):
        n = len(set(tokens[row, 1:7].tolist()))
        targets = tokens[row, positions + 1]
        losses = -copy[row].gather(-1, targets[:, None]).squeeze(-1).log()
        assert losses.tolist() == pytest.approx([math.log(n)] * len(positions))


def test_truth_is_the_chains_transition_row():
    task = MarkovICL(k=3, seed=4)
    ids = np.arange(5)
    chains = task.chains(ids)
    reference = task.reference(ids, 3)
    last = task.seq_len - 2
    for row in range(5):
        current = int(chains.tokens[row, last])
        assert reference.truth[row, 0].tolist() == pytest.approx(chains.transition[row, current].tolist())
    assert reference.positions.tolist() == [last]
    assert torch.equal(reference.tokens, chains.tokens)


def test_chains_follow_their_transition_matrix_and_start_stationary():
    chains = sample_chains(0, np.arange(4000), 3, 2, 1.0, 1, False)
    tokens, transition = chains.tokens.numpy(), chains.transition
    start = reference_predictors.stationary(transition)
    assert abs(tokens[:, 0].mean() - start[:, 1].mean()) < 0.02  # P(first = 1) = E[π_1]
    switch = transition[np.arange(4000), tokens[:, 0], 1]  # P(second = 1 | first)
    assert abs(tokens[:, 1].mean() - switch.mean()) < 0.02
    trigram = sample_chains(0, np.arange(2), 3, 2, 1.0, 2, False).transition  # (2, 4 contexts, 2)
    pairs = context_chain(trigram, 2, 2)  # (2, 4, 4): a stochastic matrix on contexts
    assert np.allclose(pairs.sum(-1), 1)
    assert np.allclose(pairs[:, 1, 2], trigram[:, 1, 0]) and np.allclose(pairs[:, 1, 3], trigram[:, 1, 1])


def test_doubly_stochastic_chains_have_uniform_columns():
    chains = MarkovICL(k=3, doubly_stochastic=True).chains(np.arange(8))
    assert np.allclose(chains.transition.sum(-2), 1, atol=1e-9)
    assert np.allclose(chains.transition.sum(-1), 1)


def test_a_model_that_outputs_a_strategy_has_kl_zero_to_it():
    from metrics.dynamics.strategy_readings import strategy_kls

    reference = MarkovICL(k=3).reference(np.arange(64), 3)
    for name, q in reference.strategies.items():
        kls = strategy_kls(reference.strategies, q.log())
        assert kls[name].abs().max() < 1e-12
        assert all(kls[other].min() >= 0 for other in kls)


@pytest.mark.parametrize("k", [2, 3])
def test_monte_carlo_kl_of_the_strategies_agrees_with_the_paper(k):
    """Our KL(truth ‖ strategy) at T = 100 over 4,000 held-out chains, within 3 standard errors of
    Edelman et al.'s (``python -m bench.strategy_nulls`` prints the table)."""
    lines = monte_carlo_lines(k)
    for name, published in PUBLISHED[k].items():
        mean, stderr = lines[name]
        assert abs(mean - published) < 3 * stderr, (name, mean, stderr)


def test_markov_probe_is_held_out_chains_read_in_halves():
    task = MarkovICL(k=3, seed=0)
    probe = task.probe(0, 8, 16, 3)
    assert probe.tokens.shape == (8, 101) and probe.n == 50 and probe.first_start == 0
    assert probe.repeated == slice(50, 99) and int(probe.tokens.max()) <= 2
    trained = task.sampler(3)(np.arange(8))
    assert not torch.equal(probe.tokens, trained)  # its own seed stream, not the training samples


def test_sentence_gap_copy_scores_a_repeat_from_its_second_token_when_its_first_copy_is_in_the_row():
    from data.tasks.sentence_gap_copy import repeat_positions

    # three rows of 8 (BOS = 9), written out: [BOS] 1 2 3 | gap 5 | 1 2 3, then [BOS] 4 6 | 4 6 (no
    # gap), then [BOS] 7 8 | 7 8 straddling rows 1 and 2, then [BOS] 0 0 | gap 0 | 0 0
    copied_from = torch.tensor(
        [
            [-1, -1, -1, -1, -1, 1, 2, 3],
            [-1, -1, -1, 9, 10, -1, -1, -1],
            [14, 15, -1, -1, -1, -1, 19, 20],
        ]
    )
    scored = repeat_positions(copied_from)
    assert scored.shape == (3, 7)
    # row 0: positions 5 and 6 predict the copy's 2 and 3 (position 4 predicts its first token, 1: not
    # recallable); row 1: position 3 predicts 6; row 2: position 0 predicts 8, whose first copy's 7 is in
    # row 1 (not scored), position 6 predicts the last 0
    assert [row.nonzero()[:, 0].tolist() for row in scored] == [[5, 6], [3], [6]]


def test_sentence_gap_copy_records_where_each_second_copy_comes_from():
    from data.tasks.sentence_gap_copy import sentence_gap_packed, sentence_gap_tokens

    n_random = 9
    packed = sentence_gap_packed(1, np.arange(30), 16, n_random, max_sentence=4, max_gap=3)
    assert torch.equal(packed.tokens, sentence_gap_tokens(1, np.arange(30), 16, n_random, max_sentence=4, max_gap=3))
    flat, source = packed.tokens.flatten().tolist(), packed.copied_from.flatten().tolist()
    starts = [i for i, token in enumerate(flat) if token == n_random]
    for begin, end in zip(starts, starts[1:]):  # each complete segment: -1 up to its second copy, then its sentence
        copied = [k for k in range(begin, end) if source[k] >= 0]
        s = len(copied)
        assert 1 <= s <= 4 and copied == list(range(end - s, end))
        assert [source[k] for k in copied] == list(range(begin + 1, begin + 1 + s))
        assert [flat[k] for k in copied] == flat[begin + 1 : begin + 1 + s]


def test_sentence_gap_copy_strategies_by_hand_on_the_repeats():
    from data.tasks.sentence_gap_copy import repeat_positions, sentence_gap_packed

    task = tasks()["sentence_gap_copy"](seq_len=40, max_sentence=8, max_gap=6, seed=2)
    n_random = 20
    ids = np.arange(500, 532)
    reference = task.reference(ids, n_random)
    tokens, scored = reference.tokens, reference.scored
    assert tokens.shape == (32, 40) and reference.positions.tolist() == list(range(39)) and reference.truth is None
    assert list(reference.strategies) == ["uniform", "copy", "induction"] and scored.any(1).all()
    for length in (32, 64, 128):  # the first 32 rows with a repeat to score of a stream as long, or longer
        drawn = sentence_gap_packed(2, np.arange(500, 500 + length), 40, n_random, 8, 6)
        repeats = repeat_positions(drawn.copied_from)
        rows = [r for r in range(length) if repeats[r].any()]
        if len(rows) >= 32:
            break
    assert torch.equal(tokens, drawn.tokens[rows[:32]]) and torch.equal(scored, repeats[rows[:32]])
    checked = right = latest = 0
    for row in range(len(tokens)):
        line = tokens[row].tolist()
        for j in scored[row].nonzero()[:, 0].tolist():
            matched = {}  # earlier i followed by a task token -> how far back tokens agree from i and j
            for i in range(j):
                if line[i + 1] < n_random:
                    k = 0
                    while k <= i and line[i - k] == line[j - k]:
                        k += 1
                    matched[i] = k
            longest = max(matched.values())
            assert longest >= 1  # token j seen before (its first copy at least)
            expected = torch.zeros(n_random, dtype=torch.float64)
            for i, k in matched.items():
                if k == longest:
                    expected[line[i + 1]] += 1
            expected /= expected.sum()
            assert torch.allclose(reference.strategies["induction"][row, j], expected, rtol=0, atol=1e-15)
            right += expected[line[j + 1]].item() == 1.0
            latest += reference_predictors.induction(tokens[row : row + 1], n_random)[0, j, line[j + 1]].item() == 1.0
            seen = sorted({t for t in line[: j + 1] if t < n_random})
            copy = reference.strategies["copy"][row, j]
            assert copy[seen].tolist() == pytest.approx([1 / len(seen)] * len(seen)) and copy.sum() == pytest.approx(1)
            checked += 1
    # it recalls what the copy repeats (but for ties), more often than the latest occurrence alone does
    assert checked > 32 and right > 0.75 * checked and right > latest
    # the induction strategy names the next token wherever the current one occurred once before
    hits = [
        reference.strategies["induction"][row, j, tokens[row, j + 1]].item()
        for row in range(len(tokens))
        for j in scored[row].nonzero()[:, 0].tolist()
        if tokens[row, : j + 1].tolist().count(tokens[row, j].item()) == 2
    ]
    assert hits and all(hit == 1.0 for hit in hits)


def test_sentence_gap_copy_refuses_options_with_nothing_to_score():
    task = tasks()["sentence_gap_copy"](seq_len=40, max_sentence=1)  # one-token sentences: no second token
    with pytest.raises(ValueError, match="too few for the strategies"):
        task.reference(np.arange(8), 20)


def test_scored_positions_must_be_booleans_of_the_strategies_shape_with_one_per_sequence():
    q = {"uniform": reference_predictors.uniform(torch.zeros(2, 3, dtype=torch.long), 4)}
    tokens, positions = torch.zeros(2, 3, dtype=torch.long), torch.arange(3)
    with pytest.raises(ValueError, match="booleans"):
        reference_predictors.ReferencePredictions(tokens, positions, q, scored=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="every sequence"):
        reference_predictors.ReferencePredictions(tokens, positions, q, scored=torch.tensor([[True] * 3, [False] * 3]))
    values = torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 7.0]])
    scored = torch.tensor([[True, False, True], [False, True, False]])
    assert reference_predictors.scored_mean(values, scored).tolist() == [2.5, 5.0]
    assert reference_predictors.scored_mean(values, None).tolist() == pytest.approx([7 / 3, 5.0])
