"""Data properties: repeat structure, determinism, independence from batching, disjoint ranks,
resumability, and the bigram-trigger rule."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from data.datamodule import TokenStream
from data.probe import make_probe_batch
from data.tasks.bigram_triggers import bigram_trigger_tokens, make_chain
from data.tasks.repeated import Repeated, repeated_tokens

N_RANDOM, BOS = 50, 50


def test_repeated_tokens_are_periodic_after_bos():
    ids = np.arange(200)
    tokens = repeated_tokens(3, ids, 33, N_RANDOM, 5, 16, bos=True)
    assert tokens.shape == (200, 33)
    assert (tokens[:, 0] == BOS).all() and (tokens[:, 1:] < N_RANDOM).all()
    periods = set()
    for row in tokens[:, 1:]:
        period = next(n for n in range(5, 17) if torch.equal(row[n:], row[:-n]))
        periods.add(period)
    assert periods == set(range(5, 17)) or len(periods) >= 10  # every length in range gets drawn


def test_repeated_without_bos_and_fixed_n_is_the_probe_layout():
    tokens = repeated_tokens(0, np.arange(4), 8, N_RANDOM, 4, 4, bos=False)
    assert torch.equal(tokens[:, :4], tokens[:, 4:])


def test_sample_is_a_pure_function_of_seed_and_id():
    batch = repeated_tokens(7, np.arange(10, 20), 21, N_RANDOM, 3, 10)
    alone = repeated_tokens(7, np.array([15]), 21, N_RANDOM, 3, 10)
    assert torch.equal(batch[5], alone[0])
    assert torch.equal(batch, repeated_tokens(7, np.arange(10, 20), 21, N_RANDOM, 3, 10))
    assert not torch.equal(batch, repeated_tokens(8, np.arange(10, 20), 21, N_RANDOM, 3, 10))


def test_ranks_draw_disjoint_samples():
    sampler = Repeated(seed=0, seq_len=21, n_min=3, n_max=10).sampler(N_RANDOM)
    streams = [TokenStream(sampler, batch_size=4, rank=r, world_size=3) for r in range(3)]
    ids = [set(np.concatenate([s.sample_ids(i) for i in range(50)]).tolist()) for s in streams]
    for a, b in itertools.combinations(ids, 2):
        assert not a & b
    assert set.union(*ids) == set(range(3 * 4 * 50))  # and together cover every sample once
    first = [next(iter(s)) for s in streams]
    assert not torch.equal(first[0], first[1])


def test_stream_restarted_at_a_batch_index_continues_exactly():
    """The datamodule resumes by starting the stream at the trainer's step (see test_resume)."""
    sampler = Repeated(seed=1, seq_len=21, n_min=3, n_max=10).sampler(N_RANDOM)
    run = iter(TokenStream(sampler, batch_size=4))
    batches = [next(run) for _ in range(6)]
    resumed = TokenStream(sampler, batch_size=4)
    resumed.next_batch = 5
    assert torch.equal(next(iter(resumed)), batches[5])
    assert not torch.equal(batches[0], batches[1])


def test_bigram_triggers_follow_their_per_sequence_output():
    chain = make_chain(0, 20, n_triggers=3)
    tokens = bigram_trigger_tokens(chain, 0, np.arange(64), 65, bos=True)
    assert tokens.shape == (64, 65) and (tokens[:, 0] == 20).all()
    body = tokens[:, 1:]
    outputs_seen = 0
    for row in body:
        for trigger in chain.triggers.tolist():
            followers = {int(row[t + 1]) for t in range(len(row) - 1) if row[t] == trigger}
            assert len(followers) <= 1  # a trigger is always followed by the same token in a sequence
            outputs_seen += len(followers)
    assert outputs_seen > 64  # triggers do occur
    # and the output differs between sequences
    trigger = chain.triggers[0].item()
    outputs = {int(row[t + 1]) for row in body for t in range(len(row) - 1) if row[t] == trigger}
    assert len(outputs) > 3


def test_bigram_background_follows_the_chain():
    chain = make_chain(1, 6, n_triggers=1, concentration=0.3)
    tokens = bigram_trigger_tokens(chain, 2, np.arange(400), 101, bos=False)
    transition = torch.diff(chain.cumulative, dim=1, prepend=torch.zeros(6, 1, dtype=chain.cumulative.dtype))
    counts = torch.zeros(6, 6)
    for row in tokens:
        for a, b in zip(row[:-1].tolist(), row[1:].tolist()):
            if a != chain.triggers[0]:
                counts[a, b] += 1
    empirical = counts / counts.sum(1, keepdim=True)
    rows = [a for a in range(6) if a != chain.triggers[0] and counts[a].sum() > 2000]
    assert rows
    torch.testing.assert_close(empirical[rows].double(), transition[rows], atol=0.03, rtol=0)


def test_probe_is_fixed_and_held_out():
    probe = make_probe_batch(0, 16, 8, N_RANDOM)
    again = make_probe_batch(0, 16, 8, N_RANDOM)
    assert torch.equal(probe.tokens, again.tokens)
    assert probe.tokens.shape == (16, 17) and probe.repeat_start == 9
    assert torch.equal(probe.tokens[:, 1:9], probe.tokens[:, 9:])
    train = repeated_tokens(0, np.arange(16), 17, N_RANDOM, 8, 8)
    assert not (probe.tokens == train).all(1).any()  # not the training samples with the same seed


def test_sentence_gap_copy_packs_bos_sentence_gap_sentence_segments():
    from data.tasks.sentence_gap_copy import sentence_gap_tokens

    n_random = 999
    tokens = sentence_gap_tokens(3, np.arange(40, 48), 100, n_random)
    assert tokens.shape == (8, 100) and int(tokens.max()) == n_random and int(tokens.min()) >= 0
    flat = tokens.flatten().tolist()
    starts = [i for i, token in enumerate(flat) if token == n_random]
    assert starts[0] == 0 and len(starts) > 5  # packed: segments run across rows
    assert any(tokens[r, 0] != n_random for r in range(1, 8))  # so a row need not start with BOS
    for begin, end in zip(starts, starts[1:]):  # every complete segment is s g s, |s| in 1..50, |g| in 0..50
        segment = flat[begin + 1 : end]
        assert any(
            segment[:s] == segment[len(segment) - s :] and 0 <= len(segment) - 2 * s <= 50 for s in range(1, 51)
        ), segment
    again = sentence_gap_tokens(3, np.arange(40, 48), 100, n_random)
    assert torch.equal(tokens, again)  # a pure function of (seed, first id, batch size)
    assert not torch.equal(tokens, sentence_gap_tokens(3, np.arange(48, 56), 100, n_random))


def test_sentence_gap_copy_in_the_seed_scripts_form_copies_two_to_fifty_one_tokens():
    """Seed 002's script copies ``sent_len + 1`` tokens for ``sent_len ~ U{1..50}``."""
    from data.tasks.sentence_gap_copy import sentence_gap_tokens

    n_random = 999
    flat = sentence_gap_tokens(5, np.arange(0, 200), 100, n_random, max_sentence=51, min_sentence=2).flatten().tolist()
    starts = [i for i, token in enumerate(flat) if token == n_random]
    lengths = set()
    for begin, end in zip(starts, starts[1:]):
        segment = flat[begin + 1 : end]
        fits = [
            s for s in range(1, 52) if segment[:s] == segment[len(segment) - s :] and 0 <= len(segment) - 2 * s <= 50
        ]
        assert fits and max(fits) >= 2, segment  # a 1-token sentence never occurs
        lengths.add(max(fits))
    assert min(lengths) == 2 and max(lengths) == 51, sorted(lengths)


def test_init_std_draws_every_weight_matrix_from_that_normal():
    from models.transformer import AttentionOnlyTransformer, TransformerShape

    torch.manual_seed(0)
    model = AttentionOnlyTransformer(
        TransformerShape(n_layers=2, n_heads=2, d_model=64, d_head=32, n_ctx=100, d_vocab=1000),
        init="normal",
        init_std=0.02,
    )
    for name, weight in model.named_parameters():
        assert abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002, name
