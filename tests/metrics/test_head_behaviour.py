"""Behaviour scores, nulls, types and type switches (metrics/heads/behaviour.py) on hand-built heads:
each planted head's pattern is supported on its behaviour's target keys where that behaviour is
defined and uniform causal attention elsewhere, on the repeated probe and on in-context Markov chains."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data.probe import ProbeBatch, make_probe_batch
from data.tasks.markov_icl import sample_chains
from metrics.disk_cache import CACHE_ENV
from metrics.heads import behaviour as behaviour_module
from metrics.heads.behaviour import (
    BUILT_IN_BEHAVIOURS,
    MIN_EXCESS,
    MIN_Z,
    PREFIX_MATCHING,
    UNSPECIALISED,
    applicable_behaviours,
    behaviour_scores,
    behaviour_targets,
    cached_random_null,
    head_types,
    null_from_permuted_tokens,
    null_from_random_patterns,
    per_sequence_scores,
    permuted_tokens,
    resampled_scores,
    type_names,
    type_names_of,
    type_switches,
)
from models.attention import causal_softmax

BEHAVIOURS = BUILT_IN_BEHAVIOURS  # no extension is installed here: the registered ones are the built-in ones
TYPES = type_names_of(BEHAVIOURS)

DRAWS = 100  # random heads or permutations per null in these tests
Z_BELOW = (
    0.5  # a head with no mass on a behaviour's keys scores at most uniform's: z <= 0 up to the null's sampling error
)
Z_CHANCE = 3.0  # two-sided bound where a score is chance by construction (the permuted null on i.i.d. tokens)


def index(name: str) -> int:
    return BEHAVIOURS.index(name)


def planted(targets, name: str) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` (float64): uniform over ``name``'s targets where it is defined, uniform
    causal attention elsewhere."""
    mask = targets.masks[index(name)].double()
    s = mask.shape[-1]
    uniform = torch.ones(s, s, dtype=torch.float64).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    rows = mask.sum(-1, keepdim=True)
    return torch.where(rows > 0, mask / rows.clamp_min(1), uniform.expand_as(mask))[:, None]


def uniform_scores(targets) -> torch.Tensor:
    s = targets.masks.shape[-1]
    uniform = torch.ones(s, s, dtype=torch.float64).tril()
    uniform = (uniform / uniform.sum(-1, keepdim=True)).expand(targets.masks.shape[1], 1, s, s)
    return behaviour_scores(uniform, targets)[0]


def distinct_probe(seed: int, batch: int, n: int, n_random: int) -> ProbeBatch:
    """The default probe's rows whose block has no repeated token (where prefix matching and the
    offset-``(n - 1)`` score coincide)."""
    probe = make_probe_batch(seed, batch, n, n_random)
    block = probe.tokens[:, 1 : 1 + n]
    keep = (block[:, :, None] == block[:, None, :]).sum((-1, -2)) == n
    assert keep.sum() >= batch // 2
    return ProbeBatch(probe.tokens[keep], n, probe.first_start)


def chains(seed: int, batch: int, seq_len: int, k: int) -> torch.Tensor:
    return sample_chains(seed, np.arange(batch), seq_len, k, 1.0, 1, False).tokens


PROBE_HEADS = ("previous_token", "current_token", "first_token", "duplicate_token", "induction")
CHAIN_HEADS = ("previous_token", "current_token", "first_token", "duplicate_token", "statistical_induction")


def test_masks_on_a_hand_written_sequence():
    tokens = torch.tensor([[9, 1, 2, 1, 2, 1]])  # BOS = 9
    targets = behaviour_targets(tokens, bos_id=9)
    keys = {
        name: [targets.masks[index(name), 0, q].nonzero().flatten().tolist() for q in range(6)] for name in BEHAVIOURS
    }
    assert keys["previous_token"] == [[], [0], [1], [2], [3], [4]]
    assert keys["current_token"] == [[0], [1], [2], [3], [4], [5]]
    assert keys["first_token"] == [[], [0], [0], [0], [0], [0]]
    assert keys["duplicate_token"] == [[], [], [], [1], [2], [1, 3]]
    assert keys["induction"] == [[], [], [], [2], [3], [2, 4]]  # the token after each earlier 1 (after 2 at q=4)
    assert keys["statistical_induction"] == keys["induction"]
    assert targets.counts[:, 0].tolist() == [5, 6, 5, 3, 3, 3]
    # a self-transition makes the current key a prefix match (x_{q-1} = x_q) and BOS matches nothing
    self_transition = behaviour_targets(torch.tensor([[9, 3, 3]]), bos_id=9).masks[index("induction"), 0, 2]
    assert self_transition.tolist() == [False, False, True]
    assert not behaviour_targets(torch.tensor([[9, 9]]), bos_id=9).masks[index("duplicate_token")].any()


def test_applicable_behaviours():
    no_repeat = behaviour_targets(torch.arange(10)[None])
    assert applicable_behaviours(no_repeat) == ("previous_token", "current_token", "first_token")
    repeats = behaviour_targets(chains(0, 4, 20, 3))
    assert applicable_behaviours(repeats, "statistical_induction") == CHAIN_HEADS
    assert applicable_behaviours(repeats) == PROBE_HEADS
    with pytest.raises(ValueError):
        applicable_behaviours(repeats, "duplicate_token")
    with pytest.raises(ValueError, match="share their targets"):
        head_types(torch.zeros(len(BEHAVIOURS)), null_from_random_patterns(repeats, draws=4), BEHAVIOURS)


def test_token_induction_equals_offset_induction_on_the_repeated_probe():
    probe = distinct_probe(seed=3, batch=32, n=8, n_random=256)
    generator = torch.Generator().manual_seed(0)
    b, s = probe.tokens.shape
    pattern = causal_softmax(2 * torch.randn(2, b, 3, s, s, generator=generator, dtype=torch.float64))  # layers
    scores = behaviour_scores(pattern, behaviour_targets(probe.tokens, bos_id=256))
    queries = torch.arange(probe.repeat_start, probe.repeat_start + probe.n)  # the repeat: each token's first
    offset = pattern[..., queries, queries - (probe.period - 1)].mean(-1).mean(-2)  # occurrence's follower, by hand
    torch.testing.assert_close(scores[..., index("induction")], offset, rtol=0, atol=1e-12)


def test_per_sequence_scores_and_their_mean():
    tokens = chains(1, 6, 12, 2)
    targets = behaviour_targets(tokens[:, :3])  # short: some sequences have no repeat
    generator = torch.Generator().manual_seed(0)
    pattern = causal_softmax(torch.randn(6, 2, 3, 3, generator=generator, dtype=torch.float64))
    per_sequence = per_sequence_scores(pattern, targets)  # (b, h, behaviours)
    for b in range(6):
        for n in range(len(BEHAVIOURS)):
            defined = targets.masks[n, b].any(-1)
            expected = (pattern[b] * targets.masks[n, b]).sum(-1)[:, defined].mean(-1)
            if defined.any():
                torch.testing.assert_close(per_sequence[b, :, n], expected)
            else:
                assert per_sequence[b, :, n].isnan().all()
    torch.testing.assert_close(behaviour_scores(pattern, targets), per_sequence.nanmean(0), equal_nan=True)
    once = torch.ones(1, 6, dtype=torch.long)
    torch.testing.assert_close(
        resampled_scores(per_sequence[None], once)[0, 0], per_sequence.nanmean(0), equal_nan=True
    )


def test_permuted_tokens_keep_bos_and_each_sequence_multiset():
    tokens = make_probe_batch(0, 8, 6, 16).tokens
    moved = permuted_tokens(tokens, torch.Generator().manual_seed(0), bos_id=16)
    assert (moved[:, 0] == 16).all() and not torch.equal(moved, tokens)
    assert torch.equal(moved.sort(-1).values, tokens.sort(-1).values)


def planted_batches():
    """(tokens, bos id, prefix-matching name, planted behaviours): the repeated probe, and chains."""
    probe = distinct_probe(seed=5, batch=24, n=10, n_random=64)
    return [
        (probe.tokens, 64, "induction", PROBE_HEADS),
        (chains(7, 16, 40, 3), None, "statistical_induction", CHAIN_HEADS),
    ]


@pytest.mark.parametrize("case", [0, 1], ids=["repeated_probe", "markov_chains"])
def test_planted_heads_score_one_on_their_behaviour_and_no_more_than_chance_on_the_others(case, record_property):
    tokens, bos_id, prefix, heads = planted_batches()[case]
    targets = behaviour_targets(tokens, bos_id)
    behaviours = applicable_behaviours(targets, prefix)
    assert behaviours == heads
    null = null_from_random_patterns(targets, draws=DRAWS)
    uniform = uniform_scores(targets)
    seq_len = tokens.shape[1]
    largest = {"disjoint": -np.inf, "overlap": -np.inf}
    for name in heads:
        scores = behaviour_scores(planted(targets, name), targets)[0]
        z = null.margins(scores)
        assert scores[index(name)].item() == pytest.approx(1.0, abs=1e-12)
        assert z[index(name)] > MIN_Z and scores[index(name)] - null.mean[index(name)] > MIN_EXCESS
        for other in behaviours:
            if other == name:
                continue
            n = index(other)
            overlap = bool((targets.masks[index(name)] & targets.masks[n]).any())
            if not overlap:  # no mass on its keys where defined, uniform's elsewhere: at most uniform's score
                assert scores[n] <= uniform[n] + 1e-12
                assert z[n] < Z_BELOW
                largest["disjoint"] = max(largest["disjoint"], z[n].item())
            else:  # shared keys carry the planted mass: the score may clear z > MIN_Z (up to ~7 on these chains,
                # where a previous-token head's key q - 1 is a prefix match whenever x_{q-2} = x_q), but
                # never by a type's absolute margin
                assert scores[n] - null.mean[n] < MIN_EXCESS
                largest["overlap"] = max(largest["overlap"], z[n].item())
    # the one overlap every batch has by construction, accounted for exactly: key 0 is query 1's previous
    # token, so a previous-token head puts 1 on the first token at query 1 alone (and vice versa)
    previous = behaviour_scores(planted(targets, "previous_token"), targets)[0]
    first = behaviour_scores(planted(targets, "first_token"), targets)[0]
    assert previous[index("first_token")].item() == pytest.approx(1 / (seq_len - 1), abs=1e-12)
    assert first[index("previous_token")].item() == pytest.approx(1 / (seq_len - 1), abs=1e-12)
    record_property("largest_off_behaviour_z", largest)
    print(f"largest off-behaviour z, {('probe', 'chains')[case]}: {largest}")


def test_the_permuted_null_reads_position_heads_on_iid_tokens_as_chance():
    """On i.i.d. tokens (a chain whose rows are all uniform) a position head's token behaviours are
    chance by construction: both nulls' two-sided bound holds under the permuted null; a content head
    clears it; position behaviours' permuted null is the score itself (margin 0)."""
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 4, (16, 30), generator=generator)
    targets = behaviour_targets(tokens)
    token_behaviours = [index(name) for name in ("duplicate_token", "statistical_induction")]
    position_behaviours = [index(name) for name in ("previous_token", "current_token", "first_token")]
    pattern = torch.cat([planted(targets, name) for name in CHAIN_HEADS], dim=1)  # (b, 5, s, s)
    null = null_from_permuted_tokens(pattern, tokens, draws=DRAWS)
    z = null.margins(behaviour_scores(pattern, targets))  # (heads, behaviours)
    assert z[:3][:, token_behaviours].abs().max() < Z_CHANCE
    assert z[:, position_behaviours].abs().max() < 1e-9
    assert z[3, index("duplicate_token")] > 20 * MIN_Z and z[4, index("statistical_induction")] > 20 * MIN_Z
    print(
        f"largest |z| of a position head's token behaviour, permuted null: {z[:3][:, token_behaviours].abs().max():.2f}"
    )


def test_type_finder_names_planted_heads_and_leaves_random_heads_unspecialised():
    rng = np.random.default_rng(0)
    right = {"repeated_probe": 0, "markov_chains": 0}
    random_unspecialised = {"repeated_probe": 0, "markov_chains": 0}
    for draw in range(20):
        n = int(rng.integers(4, 13))
        probe = make_probe_batch(draw, 8, n, int(rng.integers(8, 257)))
        chain = chains(draw, 8, int(rng.integers(16, 49)), int(rng.integers(2, 5)))
        cases = {
            "repeated_probe": (probe.tokens, int(probe.tokens[0, 0]), "induction", PROBE_HEADS),
            "markov_chains": (chain, None, "statistical_induction", CHAIN_HEADS),
        }
        for case, (tokens, bos_id, prefix, heads) in cases.items():
            targets = behaviour_targets(tokens, bos_id)
            b, s = tokens.shape
            logits = torch.randn(b, 1, s, s, dtype=torch.float64, generator=torch.Generator().manual_seed(draw))
            random_head = causal_softmax(float(rng.uniform(0.5, 3.0)) * logits)
            pattern = torch.cat([*(planted(targets, name) for name in heads), random_head], dim=1)
            null = null_from_random_patterns(targets, draws=DRAWS, seed=draw)
            found = type_names(
                head_types(behaviour_scores(pattern, targets), null, applicable_behaviours(targets, prefix))
            )
            right[case] += list(found[:-1]) == list(heads)
            random_unspecialised[case] += found[-1] == UNSPECIALISED
    print(f"planted heads named right: {right}; random head unspecialised: {random_unspecialised} (of 20)")
    assert right == {"repeated_probe": 20, "markov_chains": 20}
    assert random_unspecialised == {"repeated_probe": 20, "markov_chains": 20}


def test_type_map_over_steps_and_heads():
    targets = behaviour_targets(chains(2, 8, 24, 3))
    null = null_from_random_patterns(targets, draws=DRAWS)
    pattern = torch.stack(
        [torch.cat([planted(targets, "previous_token"), planted(targets, name)], dim=1) for name in CHAIN_HEADS]
    )  # (steps, b, heads, s, s)
    codes = head_types(
        behaviour_scores(pattern, targets), null, applicable_behaviours(targets, "statistical_induction")
    )
    assert codes.shape == (5, 2) and codes.dtype == torch.long
    assert [TYPES[c] for c in codes[:, 1].tolist()] == list(CHAIN_HEADS)
    assert (codes[:, 0] == TYPES.index("previous_token")).all()


def test_type_switches_find_a_planted_turn_and_nothing_in_a_steady_head():
    probe = make_probe_batch(0, 16, 8, 64)
    targets = behaviour_targets(probe.tokens, 64)
    behaviours = applicable_behaviours(targets)
    null = null_from_random_patterns(targets, draws=DRAWS)
    b, s = probe.tokens.shape
    generator = torch.Generator().manual_seed(0)
    steps = np.arange(0, 300, 10)
    turn = 12  # snapshot index where head 0 turns into a previous-token head
    previous = planted(targets, "previous_token")[:, 0]
    per_sequence = []
    for i in range(len(steps)):
        noise = causal_softmax(torch.randn(b, 3, s, s, generator=generator, dtype=torch.float64))
        weight = 0.6 if i >= turn else 0.0  # head 0: random, then mostly previous-token
        heads = [
            weight * previous + (1 - weight) * noise[:, 0],
            noise[:, 1],  # random throughout
            0.8 * previous + 0.2 * noise[:, 2],  # previous-token throughout
        ]
        per_sequence.append(per_sequence_scores(torch.stack(heads, 1), targets))
    per_sequence = torch.stack(per_sequence)  # (steps, b, heads, behaviours)
    found = type_switches(steps, per_sequence, null, behaviours, resamples=50)
    assert len(found[0]) == 1
    switch = found[0][0]
    assert (switch.source, switch.target, switch.step) == (UNSPECIALISED, "previous_token", float(steps[turn]))
    assert switch.low <= steps[turn] <= switch.high and switch.found > 0.9
    assert found[1] == [] and found[2] == []
    print(f"switch found at {switch.step} ({switch.low}-{switch.high}, in {switch.found:.0%} of resamples)")


def test_prefix_matching_names_share_one_score():
    targets = behaviour_targets(chains(4, 4, 16, 2))
    generator = torch.Generator().manual_seed(0)
    pattern = causal_softmax(torch.randn(4, 2, 16, 16, generator=generator, dtype=torch.float64))
    scores = behaviour_scores(pattern, targets)
    a, b = (index(name) for name in PREFIX_MATCHING)
    assert torch.equal(scores[:, a], scores[:, b])


def test_the_random_null_is_cached_on_disk_exactly_and_a_torn_file_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    targets = behaviour_targets(distinct_probe(seed=5, batch=8, n=6, n_random=64).tokens, bos_id=64)
    direct = null_from_random_patterns(targets, draws=DRAWS)
    cold = cached_random_null(targets, draws=DRAWS)
    (path,) = (tmp_path / "behaviour_nulls").glob("*.json")
    assert torch.equal(cold.mean, direct.mean) and torch.equal(cold.std, direct.std)
    other = behaviour_targets(distinct_probe(seed=6, batch=8, n=6, n_random=64).tokens, bos_id=64)
    assert not torch.equal(cached_random_null(other, draws=DRAWS).std, cold.std)  # another probe: its own file
    assert len(list((tmp_path / "behaviour_nulls").glob("*.json"))) == 2
    with monkeypatch.context() as patched:  # warm: read back bit for bit, nothing drawn
        patched.setattr(behaviour_module, "null_from_random_patterns", lambda *a: pytest.fail("recomputed"))
        warm = cached_random_null(targets, draws=DRAWS)
    assert torch.equal(warm.mean, direct.mean) and torch.equal(warm.std, direct.std)
    assert warm.mean.dtype == torch.float64
    path.write_text(path.read_text()[:15])  # torn by a crash
    torn = cached_random_null(targets, draws=DRAWS)
    assert torch.equal(torn.std, direct.std) and len(json.loads(path.read_text())["std"]) == len(BEHAVIOURS)
