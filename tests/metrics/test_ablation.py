"""K-only mean-ablation on the hand-built circuit, where the answer is known."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from data.probe import ProbeBatch, make_probe_batch
from metrics.dynamics.loss_views import repeated_loss, token_losses
from metrics.ground_truth import ablation
from metrics.ground_truth.ablation import ABLATION_KINDS, _blocks, ablation_cost, key_ablation_effects
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import PROBE, induction_circuit_model, random_model


@pytest.mark.parametrize("kind", ABLATION_KINDS)
def test_ablating_the_previous_token_head_from_the_induction_keys_breaks_induction(kind):
    effects = key_ablation_effects(induction_circuit_model(), PROBE, kind=kind)
    # averaged over all 9 query rows, of which only the 4 repeated ones can move: at most ~4/9; with
    # 3 probe sequences a per-position mean keeps a third of the head's own write (0.29 against 0.40 pooled)
    assert effects.pattern_change[0, 0, 1, 0] > 0.25
    assert effects.loss_change[0, 0, 1, 0] > 1.0  # and the repeated tokens become unpredictable
    # the K-composing pair is the one the ablation hurts most
    assert int(effects.loss_change.nan_to_num(-1.0).flatten().argmax()) == int(
        torch.tensor([0, 0, 1, 0]) @ torch.tensor([8, 4, 2, 1])
    )
    assert effects.pattern_change[0, 1, 1, 0] < 0.05  # the small random distractor barely matters
    assert effects.pattern_change[1, 0, 0, 0].isnan()  # masked: layer order


def test_a_head_that_writes_nothing_has_exactly_zero_effect():
    model = induction_circuit_model()
    with torch.no_grad():
        model.layers[0].W_O[1].zero_()  # L0H1 writes nothing: its mean equals its output
    effects = key_ablation_effects(model, PROBE)
    assert effects.pattern_change[0, 1, 1, 0] == 0 and effects.pattern_change[0, 1, 1, 1] == 0
    assert effects.loss_change[0, 1, 1, 0] == 0


def test_ablation_leaves_mode_and_weights_alone():
    model = induction_circuit_model().train()
    before = [p.clone() for p in model.parameters()]
    key_ablation_effects(model, PROBE)
    assert model.training
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_given_clean_run_gives_the_same_effects():
    model = induction_circuit_model().eval()
    with torch.no_grad():
        clean_run = model.run_with_cache(PROBE.tokens)
    given, fresh = key_ablation_effects(model, PROBE, clean_run), key_ablation_effects(model, PROBE)
    for name, values in given.effects().items():
        torch.testing.assert_close(values, fresh.effects()[name], equal_nan=True)


def replaced(write, kind):
    """``write [b, t, d]``'s replacement, written out by hand: the batch mean at each position, the
    mean over batch and positions, or the next sequence's write (cyclically)."""
    b, t, _ = write.shape
    if kind == "per_position":
        return torch.stack([sum(write[i, p] for i in range(b)) / b for p in range(t)])[None].expand_as(write)
    if kind == "pooled":
        return (sum(write[i, p] for i in range(b) for p in range(t)) / (b * t)).expand_as(write)
    return torch.stack([write[(i + 1) % b] for i in range(b)])


def per_pair_loop(model, probe, kind="per_position"):
    """The obvious way: for each pair, rebuild the reader's keys from an ablated stream, recompute its
    layer with that one head's pattern swapped, and run the rest of the model on it."""
    tokens = probe.tokens
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        clean = repeated_loss(token_losses(logits, tokens), probe)
        L, H = model.shape.n_layers, model.shape.n_heads
        patterns = torch.full((L, H, L, H), float("nan"), dtype=torch.float64)
        losses = patterns.clone()
        pos = model.positions(tokens.shape[1])  # shortformer positions (None: they are in the stream)
        out = lambda layer, x, pattern: (
            x + layer.head_outputs(x, pattern).sum(dim=1) + (0 if layer.b_O is None else layer.b_O)
        )
        for l1, h1, l2, h2 in [
            (a, b, c, d) for a in range(L) for b in range(H) for c in range(a + 1, L) for d in range(H)
        ]:
            write = cache["head_out"][l1][:, h1]
            x = cache["resid_pre"][l2]
            ablated = model.layers[l2].pattern(x, x - write + replaced(write, kind), pos)[:, h2]
            patterns[l1, h1, l2, h2] = 0.5 * (ablated - cache["pattern"][l2][:, h2]).abs().sum(-1).mean()
            mixed = cache["pattern"][l2].clone()
            mixed[:, h2] = ablated
            x = out(model.layers[l2], x, mixed)
            for layer in model.layers[l2 + 1 :]:
                x = out(layer, x, layer.pattern(x, pos=pos))
            losses[l1, h1, l2, h2] = repeated_loss(token_losses(model.unembed(x), tokens), probe) - clean
    return patterns, losses


BUDGETS = [1, 400_000, 2_500_000, ablation.DEFAULT_MAX_CHUNK_BYTES]  # one row per block ... one block per reader layer


@pytest.mark.parametrize("max_chunk_bytes", BUDGETS)
@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_batched_effects_equal_the_per_pair_loop(normalization, max_chunk_bytes, monkeypatch):
    blocks = []

    def recorded(*args):
        blocks.extend(found := list(_blocks(*args)))
        return iter(found)

    monkeypatch.setattr(ablation, "_blocks", recorded)
    model = random_model(normalization, n_layers=3, n_heads=3).double().eval()  # readers in layers 1 and 2, 27 pairs
    probe = make_probe_batch(0, 6, 8, 10)
    effects = key_ablation_effects(model, probe, max_chunk_bytes=max_chunk_bytes)
    patterns, losses = per_pair_loop(model, probe)
    torch.testing.assert_close(effects.pattern_change, patterns, rtol=1e-9, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(effects.loss_change, losses, rtol=1e-9, atol=1e-12, equal_nan=True)
    assert (effects.loss_change[~effects.loss_change.isnan()].abs() > 1e-6).any()  # not a vacuous comparison
    rows = 3 * 6 + 6 * 6  # (writer, sequence) rows: 3 writers x 6 sequences for reader layer 1, 6 x 6 for layer 2
    if max_chunk_bytes == 1:
        assert len(blocks) == rows  # a row per block
    elif max_chunk_bytes == ablation.DEFAULT_MAX_CHUNK_BYTES:
        assert len(blocks) == 2  # a block per reader layer
    else:
        assert 2 < len(blocks) < rows


@pytest.mark.parametrize("kind", ABLATION_KINDS)
@pytest.mark.parametrize("normalization", ["none", "layernorm"])
@pytest.mark.parametrize("max_chunk_bytes", [400_000, ablation.DEFAULT_MAX_CHUNK_BYTES])
def test_every_ablation_kind_equals_its_per_pair_loop(kind, normalization, max_chunk_bytes):
    model = random_model(normalization, n_layers=3, n_heads=3).double().eval()
    probe = make_probe_batch(0, 6, 8, 10)
    effects = key_ablation_effects(model, probe, max_chunk_bytes=max_chunk_bytes, kind=kind)
    patterns, losses = per_pair_loop(model, probe, kind)
    torch.testing.assert_close(effects.pattern_change, patterns, rtol=1e-9, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(effects.loss_change, losses, rtol=1e-9, atol=1e-12, equal_nan=True)


def test_the_ablation_kinds_differ():
    model = random_model("none", n_layers=3, n_heads=3).double().eval()
    probe = make_probe_batch(0, 6, 8, 10)
    changes = {kind: later_pairs(key_ablation_effects(model, probe, kind=kind).loss_change) for kind in ABLATION_KINDS}
    for a, b in [("per_position", "pooled"), ("per_position", "resample"), ("pooled", "resample")]:
        assert (changes[a] - changes[b]).abs().max() > 1e-6, (a, b)


def later_pairs(effect):
    return effect[~effect.isnan()]


@pytest.mark.parametrize("rows", [1, 4, 6, 13, 40])
def test_blocks_cover_the_writer_sequence_grid_once(rows):
    covered = torch.zeros(7, 6, dtype=torch.int64)
    for writers, sequences in _blocks(7, 6, rows):
        covered[writers, sequences] += 1
        assert (writers.stop - writers.start) * (sequences.stop - sequences.start) <= rows
    assert (covered == 1).all()


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
@pytest.mark.parametrize("n_layers", [2, 3, 5])
def test_the_cost_formula_counts_every_matmul(normalization, n_layers):
    """``ablation_cost`` lists, term by term, the reader layer and the layers after it (nothing
    below is run again); a FLOP counter on the real run must find exactly that."""
    model = random_model(normalization, n_layers=n_layers, n_heads=3).eval()
    probe = make_probe_batch(0, 6, 8, 10)
    with torch.no_grad():
        clean_run = model.run_with_cache(probe.tokens)
    with FlopCounterMode(display=False) as counter:
        key_ablation_effects(model, probe, clean_run)
    assert counter.get_total_flops() == ablation_cost(model.shape, 6, 17)


def test_the_cost_formula_counts_a_gapped_probes_scored_positions():
    """A probe with a gap between its copies scores ``n - 1`` positions of ``t = 1 + 2n + gap`` (not ``t // 2 - 1``)."""
    model = random_model("layernorm", n_layers=3, n_heads=2).eval()
    plain = make_probe_batch(0, 4, 6, 10)
    gap = torch.randint(0, 10, (4, 4), generator=torch.Generator().manual_seed(0))
    tokens = torch.cat([plain.tokens[:, :7], gap, plain.tokens[:, 7:]], dim=1)  # [BOS] t_1..t_6, gap, t_1..t_6
    probe = ProbeBatch(tokens, 6, first_start=1, gap=4)
    with torch.no_grad():
        clean_run = model.run_with_cache(probe.tokens)
    with FlopCounterMode(display=False) as counter:
        key_ablation_effects(model, probe, clean_run)
    assert counter.get_total_flops() == ablation_cost(model.shape, 4, 17, n_scored=5)
    assert ablation_cost(model.shape, 4, 17) != ablation_cost(model.shape, 4, 17, n_scored=5)


def test_the_ablation_is_cheaper_than_before():
    """FLOPs of the previous batched ablation (d_model-wide keys and outputs for every pair),
    counted with FlopCounterMode on the default model shape and on 2 x 12 x 768 x 64."""
    default = TransformerShape(n_layers=2, n_heads=2, d_model=64, d_head=16, n_ctx=33, d_vocab=257)
    wide = TransformerShape(n_layers=2, n_heads=12, d_model=768, d_head=64, n_ctx=33, d_vocab=257)
    assert ablation_cost(default, 32, 33) < 0.5 * 1.27e8
    assert ablation_cost(wide, 32, 33) < 0.2 * 6.37e10


def test_scale_zero_changes_nothing_and_scale_one_is_the_mean_ablation():
    model = random_model("layernorm", n_layers=3, n_heads=2)
    probe = make_probe_batch(0, 4, 8, 10)
    nothing, mean = key_ablation_effects(model, probe, scale=0.0), key_ablation_effects(model, probe, scale=1.0)
    later = ~nothing.loss_change.isnan()
    assert (nothing.loss_change[later] == 0).all() and (nothing.pattern_change[later] == 0).all()
    for name, values in key_ablation_effects(model, probe).effects().items():
        torch.testing.assert_close(values, mean.effects()[name], equal_nan=True)


def test_a_float32_model_is_ablated_in_float32_close_to_float64():
    model = random_model("rmsnorm", n_layers=3, n_heads=3).eval()
    probe = make_probe_batch(0, 6, 8, 10)
    single, double = key_ablation_effects(model, probe), key_ablation_effects(model.double(), probe)
    for name, values in single.effects().items():
        torch.testing.assert_close(values, double.effects()[name], rtol=1e-3, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
@pytest.mark.parametrize("positions, biases", [("shortformer", False), ("standard", True), ("shortformer", True)])
def test_seed_002s_library_options_equal_the_per_pair_loop(positions, biases, normalization):
    """Shortformer positions (queries and keys only) and biases: the batched ablation equals the loop,
    whose patterns and head outputs come from the model's own layers."""
    torch.manual_seed(0)
    shape = TransformerShape(3, 3, 24, 5, 17, 11, normalization, positions, biases)
    model = AttentionOnlyTransformer(shape).double().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("b_"):
                parameter.normal_(0, 0.3)
    probe = make_probe_batch(0, 6, 8, 10)
    for budget in (400_000, ablation.DEFAULT_MAX_CHUNK_BYTES):
        effects = key_ablation_effects(model, probe, max_chunk_bytes=budget)
        patterns, losses = per_pair_loop(model, probe)
        torch.testing.assert_close(effects.pattern_change, patterns, rtol=1e-9, atol=1e-12, equal_nan=True)
        torch.testing.assert_close(effects.loss_change, losses, rtol=1e-9, atol=1e-12, equal_nan=True)
    assert (effects.loss_change[~effects.loss_change.isnan()].abs() > 1e-6).any()


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_with_training_time_interventions_in_layer_0_the_effects_are_those_of_the_model_as_it_trains(normalization):
    """A clamped writer and a mean-ablated writer (models/interventions.py): the batched effects on the
    intervened clean run equal the per-pair loop over that model; a zero-ablated writer moves nothing."""
    from models.interventions import HeadChange

    model = random_model(normalization, n_layers=3, n_heads=3)
    probe = make_probe_batch(0, 6, 5, model.shape.d_vocab - 1)
    model.set_changes(
        {0: [HeadChange(0, "clamp", "prev_token", strength=0.7), HeadChange(1, "ablate", replacement="mean")]}
    )
    effects = key_ablation_effects(model, probe, model.run_with_cache(probe.tokens))
    patterns, losses = per_pair_loop(model, probe)
    torch.testing.assert_close(effects.pattern_change, patterns, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(effects.loss_change, losses, rtol=1e-5, atol=1e-6, equal_nan=True)
    model.set_changes({0: [HeadChange(2, "ablate")]})
    zeroed = key_ablation_effects(model, probe, model.run_with_cache(probe.tokens))
    assert torch.count_nonzero(zeroed.pattern_change[0, 2, 1:]) == 0
