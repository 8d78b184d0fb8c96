"""Training-time interventions on the forward pass (models/interventions.py), checked against
patterns written out by hand and against the model without them."""

from __future__ import annotations

import pytest
import torch

from models.interventions import HeadChange, Intervention, head_problem, target_pattern
from models.transformer import AttentionOnlyTransformer, TransformerShape, causal_pattern

SHAPE = TransformerShape(n_layers=2, n_heads=3, d_model=24, d_head=8, n_ctx=14, d_vocab=7)


def tiny_model(seed: int = 0) -> AttentionOnlyTransformer:
    torch.manual_seed(seed)
    return AttentionOnlyTransformer(SHAPE).double()


def tokens(seed: int = 1, batch: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    out = torch.randint(1, SHAPE.d_vocab, (batch, SHAPE.n_ctx), generator=generator)
    out[:, 0] = 0
    return out


def hand_target(target: str, row_tokens: list[int]) -> torch.Tensor:
    """The target pattern of one sequence, one query at a time, written out from its definition."""
    t = len(row_tokens)
    pattern = torch.zeros(t, t, dtype=torch.float64)
    for i in range(t):
        if target == "prev_token":
            pattern[i, max(i - 1, 0)] = 1
        elif target == "bos":
            pattern[i, 0] = 1
        elif target == "uniform":
            pattern[i, : i + 1] = 1 / (i + 1)
        elif target == "induction":
            earlier = [j for j in range(i) if row_tokens[j] == row_tokens[i]]
            pattern[i, earlier[-1] + 1 if earlier else 0] = 1
    return pattern


@pytest.mark.parametrize("target", ["prev_token", "induction", "uniform", "bos"])
def test_a_full_clamp_imposes_the_target_exactly(target):
    model, toks = tiny_model(), tokens()
    model.set_changes({1: [HeadChange(2, "clamp", target)]})
    _, cache = model.run_with_cache(toks)
    for b in range(toks.shape[0]):
        assert torch.equal(cache["pattern"][1][b, 2], hand_target(target, toks[b].tolist()))
    assert torch.equal(target_pattern(target, toks, torch.float64)[0], hand_target(target, toks[0].tolist()))


def test_a_partial_clamp_mixes_own_and_target_and_leaves_other_heads():
    model, toks = tiny_model(), tokens()
    _, clean = model.run_with_cache(toks)
    model.set_changes({0: [HeadChange(1, "clamp", "prev_token", strength=0.5)]})
    _, cache = model.run_with_cache(toks)
    target = torch.stack([hand_target("prev_token", row.tolist()) for row in toks])
    torch.testing.assert_close(cache["pattern"][0][:, 1], 0.5 * clean["pattern"][0][:, 1] + 0.5 * target)
    assert torch.equal(cache["pattern"][0][:, [0, 2]], clean["pattern"][0][:, [0, 2]])


@pytest.mark.parametrize("replacement", ["zero", "mean", "resample"])
def test_an_ablated_heads_output_is_its_replacement(replacement):
    model, toks = tiny_model(), tokens()
    _, clean = model.run_with_cache(toks)
    model.set_changes({1: [HeadChange(0, "ablate", replacement=replacement)]})
    _, cache = model.run_with_cache(toks)
    out, own = cache["head_out"][1][:, 0], clean["head_out"][1][:, 0]  # (b, t, d): layer 1's input is clean
    if replacement == "zero":
        assert torch.equal(out, torch.zeros_like(out))
    elif replacement == "mean":
        torch.testing.assert_close(out, own.mean(0, keepdim=True).expand_as(own), rtol=0, atol=1e-13)
    else:
        torch.testing.assert_close(out, own.roll(-1, 0), rtol=0, atol=1e-13)
    assert torch.equal(cache["head_out"][1][:, 1:], clean["head_out"][1][:, 1:])  # the other heads untouched


def test_pattern_and_value_preserving_ablations():
    model, toks = tiny_model(), tokens()
    x = model.embed(toks)
    q, k, v = model.layers[0].qkv(x)
    own = causal_pattern(q, k)
    model.set_changes({0: [HeadChange(1, "ablate", replacement="mean", keep="pattern")]})
    _, cache = model.run_with_cache(toks)
    assert torch.equal(cache["pattern"][0], own)  # its own pattern, mixing the batch-mean values
    expected = own[:, 1] @ v[:, 1].mean(0, keepdim=True)
    torch.testing.assert_close(cache["head_out"][0][:, 1], expected @ model.layers[0].W_O[1], rtol=0, atol=1e-13)
    model.set_changes({0: [HeadChange(1, "ablate", replacement="resample", keep="values")]})
    _, cache = model.run_with_cache(toks)
    assert torch.equal(cache["pattern"][0][:, 1], own[:, 1].roll(-1, 0))  # another sequence's pattern, own values
    torch.testing.assert_close(
        cache["head_out"][0][:, 1], (own[:, 1].roll(-1, 0) @ v[:, 1]) @ model.layers[0].W_O[1], rtol=0, atol=1e-13
    )


def test_temperature_scales_the_scores():
    model, toks = tiny_model(), tokens()
    q, k, _ = model.layers[0].qkv(model.embed(toks))
    model.set_changes({0: [HeadChange(0, "temperature", factor=3.0)]})
    _, cache = model.run_with_cache(toks)
    torch.testing.assert_close(cache["pattern"][0][:, 0], causal_pattern(q * 3.0, k)[:, 0])


def test_the_training_path_applies_the_same_changes_and_no_gradient_crosses_them():
    model, toks = tiny_model(), tokens()
    model.set_changes({0: [HeadChange(0, "clamp", "prev_token")], 1: [HeadChange(1, "ablate")]})
    logits, _ = model.run_with_cache(toks)
    torch.testing.assert_close(model(toks), logits, rtol=0, atol=1e-12)  # fused QKV + explicit attention
    model(toks).logsumexp(-1).sum().backward()
    layer0, layer1 = model.layers
    assert torch.count_nonzero(layer0.W_Q.grad[0]) == 0 and torch.count_nonzero(layer0.W_K.grad[0]) == 0
    assert torch.count_nonzero(layer0.W_V.grad[0]) > 0  # the clamped head still learns what it moves
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        assert torch.count_nonzero(getattr(layer1, name).grad[1]) == 0  # a zero-ablated head learns nothing
        assert torch.count_nonzero(getattr(layer1, name).grad[0]) > 0


def test_changes_off_gives_the_model_back_untouched():
    model, toks = tiny_model(), tokens()
    clean, _ = model.run_with_cache(toks)
    model.set_changes({0: [HeadChange(0, "clamp", "bos")]})
    with model.changes_off():
        assert not model.intervened
        assert torch.equal(model.run_with_cache(toks)[0], clean)
    assert model.intervened


def test_head_names_are_checked_against_the_model():
    assert head_problem("L1H2", SHAPE) is None and head_problem("L0", SHAPE) is None
    assert "does not exist" in head_problem("L5H9", SHAPE)
    assert "write L<layer>H<head>" in head_problem("head0", SHAPE)
    bad = Intervention("clamp", ("L0H0",), from_step=10, until_step=5, strength=2.0)
    problems = " | ".join(bad.problems(SHAPE, max_steps=100))
    assert "from_step=10 > until_step=5" in problems and "strength=2.0 must be in [0, 1]" in problems
