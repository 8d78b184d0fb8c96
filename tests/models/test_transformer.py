"""The model: the training path and the explicit-pattern path agree; layout and errors."""

from __future__ import annotations

import pytest
import torch

from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import easytransformer_like, random_model


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_sdpa_path_equals_explicit_patterns(normalization):
    model = random_model(normalization)
    tokens = torch.randint(0, 11, (3, 17))
    logits_fast = model(tokens)
    logits_cached, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(logits_fast, logits_cached, rtol=1e-5, atol=1e-5)
    pattern = cache["pattern"][0]
    assert pattern.shape == (3, 3, 17, 17)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(3, 3, 17))
    assert pattern.triu(1).abs().max() == 0  # causal


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_the_probe_pass_without_head_writes_reads_the_same_stream(normalization):
    """``head_out=False`` (the tracker's cheap snapshots) skips the per-head writes only: logits,
    streams and patterns are bitwise those of the full pass, and the writes sum to each layer's update."""
    model = random_model(normalization).double()
    tokens = torch.randint(0, 11, (3, 17))
    logits, cache = model.run_with_cache(tokens)
    lean_logits, lean = model.run_with_cache(tokens, head_out=False)
    assert "head_out" not in lean and torch.equal(logits, lean_logits)
    for key in ("resid_pre", "pattern"):
        assert all(torch.equal(a, b) for a, b in zip(cache[key], lean[key]))
    for l in range(len(model.layers) - 1):
        torch.testing.assert_close(
            cache["resid_pre"][l] + cache["head_out"][l].sum(1), cache["resid_pre"][l + 1], rtol=1e-12, atol=1e-12
        )


def test_weight_layout_is_transformerlens():
    shape = TransformerShape(n_layers=2, n_heads=3, d_model=20, d_head=4, n_ctx=8, d_vocab=13)
    model = AttentionOnlyTransformer(shape)
    layer = model.layers[0]
    assert layer.W_Q.shape == layer.W_K.shape == layer.W_V.shape == (3, 20, 4)
    assert layer.W_O.shape == (3, 4, 20)
    assert model.W_E.shape == (13, 20) and model.W_pos.shape == (8, 20) and model.W_U.shape == (20, 13)


def test_head_outputs_sum_to_the_layer_output():
    model = random_model()
    tokens = torch.randint(0, 11, (2, 9))
    x = model.embed(tokens)
    layer = model.layers[0]
    torch.testing.assert_close(layer(x), x + layer.head_outputs(x, layer.pattern(x)).sum(1), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="normalization"):
        TransformerShape(2, 2, 16, 4, 9, 11, normalization="batchnorm")
    with pytest.raises(ValueError, match="n_heads"):
        TransformerShape(2, 0, 16, 4, 9, 11)
    model = random_model()
    with pytest.raises(ValueError, match="n_ctx"):
        model(torch.zeros(1, 18, dtype=torch.long))


def by_hand(model: AttentionOnlyTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """The forward pass written out head by head: shortformer positions join the normalized input of
    the queries and keys only (as TransformerLens), biases are added where they sit."""
    t = tokens.shape[1]
    shortformer = model.shape.positions == "shortformer"
    x = model.W_E[tokens] + (0 if shortformer else model.W_pos[:t])
    zero = lambda *size: torch.zeros(size, dtype=x.dtype)
    for layer in model.layers:
        read = layer.norm(x)
        read_qk = read + model.W_pos[:t] if shortformer else read
        out = x + (zero(model.shape.d_model) if layer.b_O is None else layer.b_O)
        for h in range(model.shape.n_heads):
            bias = lambda b, h=h: zero(model.shape.d_head) if b is None else b[h]
            q, k = read_qk @ layer.W_Q[h] + bias(layer.b_Q), read_qk @ layer.W_K[h] + bias(layer.b_K)
            v = read @ layer.W_V[h] + bias(layer.b_V)  # values read the stream: no position in it
            scores = (q @ k.mT) / model.shape.d_head**0.5
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            out = out + scores.softmax(-1) @ v @ layer.W_O[h]
        x = out
    logits = model.final_norm(x) @ model.W_U
    return logits if model.b_U is None else logits + model.b_U


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
@pytest.mark.parametrize("positions, biases", [("shortformer", False), ("standard", True), ("shortformer", True)])
def test_shortformer_and_biases_equal_the_forward_pass_written_by_hand(positions, biases, normalization):
    model = easytransformer_like(positions, biases, normalization)
    tokens = torch.randint(0, 11, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = by_hand(model, tokens)
        torch.testing.assert_close(model(tokens), expected, rtol=1e-12, atol=1e-12)
        cached, cache = model.run_with_cache(tokens)
        torch.testing.assert_close(cached, expected, rtol=1e-12, atol=1e-12)
    if positions == "shortformer":
        assert torch.equal(cache["resid_pre"][0], model.W_E[tokens])  # the stream holds no position


def test_shortformer_values_never_see_a_position():
    model = easytransformer_like("shortformer", True)
    tokens = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(2))
    moved = easytransformer_like("shortformer", True)
    with torch.no_grad():
        moved.W_pos.normal_(0, 5.0)  # other positions: the patterns change, the values do not
        x, pos, other_pos = model.embed(tokens), model.positions(9), moved.positions(9)
        for layer in model.layers:
            q, k, v = layer.qkv(x, pos)
            q2, k2, v2 = layer.qkv(x, other_pos)
            assert torch.equal(v, v2) and not torch.allclose(k, k2)


def test_biases_start_at_zero_and_train():
    model = AttentionOnlyTransformer(TransformerShape(2, 2, 16, 4, 9, 11, biases=True))
    biases = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("b_")}
    assert sorted(biases) == ["b_U", *(f"layers.{l}.b_{x}" for l in range(2) for x in "KOQV")]
    assert all(torch.equal(p, torch.zeros_like(p)) for p in biases.values())
    tokens = torch.randint(0, 11, (4, 9))
    torch.nn.functional.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in biases.values())
    assert model.shape.parameter_count == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("init, std", [("normal", 0.02), ("gpt2", 0.8 / 64**0.5)])
def test_initialisations_by_name(init, std):
    torch.manual_seed(0)
    model = AttentionOnlyTransformer(
        TransformerShape(2, 2, 64, 32, 100, 1000, "layernorm", biases=True), init, 0.02 if init == "normal" else None
    )
    for name, parameter in model.named_parameters():
        last = name.rsplit(".", 1)[-1]
        if last.startswith("W_"):
            assert parameter.std().item() == pytest.approx(std, rel=0.05), name
        else:
            assert torch.equal(
                parameter, torch.ones_like(parameter) if last == "weight" else torch.zeros_like(parameter)
            ), name
    with pytest.raises(ValueError, match="goes with init=normal"):
        AttentionOnlyTransformer(TransformerShape(2, 2, 16, 4, 9, 11), "fan_in", 0.02)
    with pytest.raises(ValueError, match="init=normal needs init_std > 0"):
        AttentionOnlyTransformer(TransformerShape(2, 2, 16, 4, 9, 11), "normal")
