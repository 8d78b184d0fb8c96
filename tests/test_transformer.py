"""The model: the training path and the explicit-pattern path agree; layout and errors."""

from __future__ import annotations

import pytest
import torch

from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.conftest import random_model


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
        torch.testing.assert_close(cache["resid_pre"][l] + cache["head_out"][l].sum(1), cache["resid_pre"][l + 1], rtol=1e-12, atol=1e-12)


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
        TransformerShape(normalization="batchnorm")
    with pytest.raises(ValueError, match="n_heads"):
        TransformerShape(n_heads=0)
    model = random_model()
    with pytest.raises(ValueError, match="n_ctx"):
        model(torch.zeros(1, 18, dtype=torch.long))
