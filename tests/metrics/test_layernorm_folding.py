"""Folding the normalization into the reading weights (docs/measures.md, "Folding normalization").

LayerNorm without bias is ``LN(x) = (x - mean(x)) / s(x) · g`` with ``s(x) = sqrt(var(x) + eps)``:
the centring ``x -> x C`` (``C = I - 11ᵀ/d_model``) and the gain are linear, so a weight ``W`` that
reads ``LN(x)`` reads ``x / s(x)`` through ``C diag(g) W``. RMSNorm has no centring: ``diag(g) W``.
Checked against a TransformerLens-style fold written out by hand, against TransformerLens's own
``ProcessWeights.fold_layer_norm`` (slow: the import takes 10-20 s), and against the model's own
forward pass.
"""

from __future__ import annotations

import pytest
import torch

from data.probe import make_probe_batch
from metrics.composition.circuits import HeadCircuits, LowRank, head_circuits
from metrics.composition.engine import composition_scores
from metrics.composition.measures import COMPOSITION_MEASURES, frobenius_ratio
from metrics.composition.scores import composition_of
from metrics.heads.circuit_scores import folded_unembedding
from tests.helpers import random_model


def transformerlens_fold(model):
    """``(W_Q, W_K, W_V, W_O, W_U)`` in float64, folded as TransformerLens's ``fold_layer_norm(...,
    fold_biases=False, center_weights=True)`` does for LayerNorm: multiply by the gain over d_model,
    then subtract the mean over d_model (``"head_index d_model d_head -> head_index 1 d_head"``); the
    unembedding likewise (its d_model axis is 0). No centring under RMSNorm or without a norm."""

    def fold(norm, W, d_model_axis):
        W = W.detach().double().clone()
        if isinstance(norm, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            shape = [1] * W.dim()
            shape[d_model_axis] = -1
            W = W * norm.weight.detach().double().reshape(shape)
        if isinstance(norm, torch.nn.LayerNorm):
            W = W - W.mean(dim=d_model_axis, keepdim=True)
        return W

    stack = lambda name: torch.stack([fold(layer.norm, getattr(layer, name), 1) for layer in model.layers])
    W_O = torch.stack([layer.W_O.detach().double() for layer in model.layers])
    return stack("W_Q"), stack("W_K"), stack("W_V"), W_O, fold(model.final_norm, model.W_U, 0)


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm", "none"])
def test_circuits_equal_a_transformerlens_style_fold_by_hand(normalization):
    model = random_model(normalization)
    W_Q, W_K, W_V, W_O, W_U = transformerlens_fold(model)
    circuits = head_circuits(model, torch.float64)
    for got, want in (
        (circuits.qk.left, W_Q),
        (circuits.qk.right, W_K),
        (circuits.ov.left, W_V),
        (circuits.ov.right, W_O.mT),
    ):
        assert relative_error(got, want) < 1e-9
    assert relative_error(circuits.qk.dense(), W_Q @ W_K.mT) < 1e-9  # W_QK = W_Q W_Kᵀ
    assert relative_error(circuits.ov.dense(), W_V @ W_O) < 1e-9  # W_OV = W_V W_O
    assert relative_error(folded_unembedding(model, torch.float64), W_U) < 1e-9


@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_frobenius_scores_equal_the_dense_hand_folded_reference(kind):
    """Every ``d_model x d_model`` circuit formed from the hand fold; the engine's scores equal
    ``‖W_OV¹ B‖ / (‖W_OV¹‖ ‖B‖)`` with ``B`` the reader's ``W_QK`` (Q), ``W_QKᵀ`` (K) or ``W_OV`` (V)."""
    model = random_model("layernorm")
    W_Q, W_K, W_V, W_O, _ = transformerlens_fold(model)
    scores = composition_scores(head_circuits(model, torch.float64), frobenius_ratio)["frobenius"][kind]
    L, H = model.shape.n_layers, model.shape.n_heads
    norm = torch.linalg.norm
    for l1 in range(L):
        for h1 in range(H):
            A = W_V[l1, h1] @ W_O[l1, h1]
            for l2 in range(l1 + 1, L):
                for h2 in range(H):
                    QK = W_Q[l2, h2] @ W_K[l2, h2].T
                    B = {"Q": QK, "K": QK.T, "V": W_V[l2, h2] @ W_O[l2, h2]}[kind]
                    want = (norm(A @ B) / (norm(A) * norm(B))).item()
                    assert scores[l1, h1, l2, h2].item() == pytest.approx(want, rel=1e-9)


def norm_scale(norm, x):
    """The per-position scalar ``s(x) [..., 1]`` a norm divides by, from the module's own eps."""
    if isinstance(norm, torch.nn.LayerNorm):
        return (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    if isinstance(norm, torch.nn.RMSNorm):
        eps = torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
        return (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return torch.ones_like(x[..., :1])


@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm", "none"])
def test_folded_weights_reproduce_the_models_own_reads(normalization):
    """The fold is exact: the model's queries, keys and values (``norm(x) @ W``) and logits
    (``final_norm(x) @ W_U``) are the folded weights applied to the un-centred ``x / s(x)``, on
    residual vectors with a large common mean (which the centring removes)."""
    model = random_model(normalization).double()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, model.shape.d_model, generator=generator, dtype=torch.float64)
    x = x + 3.0 + torch.randn(4, 9, 1, generator=generator, dtype=torch.float64)  # a mean per position
    circuits = head_circuits(model, torch.float64)
    with torch.no_grad():
        for l, layer in enumerate(model.layers):
            unscaled = x / norm_scale(layer.norm, x)  # (b, t, d): the input, divided by s(x), not centred
            for W, folded in (
                (layer.W_Q, circuits.qk.left[l]),
                (layer.W_K, circuits.qk.right[l]),
                (layer.W_V, circuits.ov.left[l]),
            ):
                model_path = layer.project(x, W)  # (b, h, t, e)
                folded_path = torch.einsum("btd,hde->bhte", unscaled, folded)
                torch.testing.assert_close(folded_path, model_path, rtol=1e-10, atol=1e-10)
            q, k = layer.project(x, layer.W_Q), layer.project(x, layer.W_K)
            folded_logits = torch.einsum(
                "btd,hde,hfe,bsf->bhts", unscaled, circuits.qk.left[l], circuits.qk.right[l], unscaled
            )
            torch.testing.assert_close(folded_logits, q @ k.mT, rtol=1e-10, atol=1e-10)  # x_i W_QK x_jᵀ, per head
        unscaled = x / norm_scale(model.final_norm, x)
        torch.testing.assert_close(
            unscaled @ folded_unembedding(model, torch.float64), model.unembed(x), rtol=1e-10, atol=1e-10
        )
        if normalization == "layernorm":  # the gain alone does not reproduce them: the centring is needed
            layer = model.layers[0]
            gain_only = layer.norm.weight[:, None] * layer.W_Q
            off = torch.einsum("btd,hde->bhte", x / norm_scale(layer.norm, x), gain_only) - layer.project(x, layer.W_Q)
            assert off.abs().max() > 1e-2


def test_centred_reading_weights_ignore_the_ones_direction():
    """Under LayerNorm every folded reading weight annihilates ``1`` (what the centring removes);
    under RMSNorm they do not (nothing is centred)."""
    ones = lambda model: torch.ones(model.shape.d_model, dtype=torch.float64)
    ln = random_model("layernorm")
    circuits = head_circuits(ln, torch.float64)
    for factor in (circuits.qk.left, circuits.qk.right, circuits.ov.left):
        assert (ones(ln) @ factor).abs().max() < 1e-12
    assert (ones(ln) @ folded_unembedding(ln, torch.float64)).abs().max() < 1e-12
    rms = random_model("rmsnorm")
    circuits = head_circuits(rms, torch.float64)
    for factor in (circuits.qk.left, circuits.qk.right, circuits.ov.left):
        assert (ones(rms) @ factor).abs().max() > 1e-2
    assert (ones(rms) @ folded_unembedding(rms, torch.float64)).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm"])
def test_fold_equals_transformerlens_fold_layer_norm(normalization):
    """TransformerLens's own ``ProcessWeights.fold_layer_norm`` on the model's weights in its
    state-dict layout, ``center_weights`` for LayerNorm only (as its docstring says for RMSNorm)."""
    weight_processing = pytest.importorskip("transformer_lens.weight_processing")
    transformer_lens = pytest.importorskip("transformer_lens")
    model = random_model(normalization).double()
    s = model.shape
    config_class = (
        getattr(transformer_lens, "TransformerBridgeConfig", None) or transformer_lens.HookedTransformerConfig
    )
    cfg = config_class(
        n_layers=s.n_layers,
        d_model=s.d_model,
        n_ctx=s.n_ctx,
        d_head=s.d_head,
        n_heads=s.n_heads,
        d_vocab=s.d_vocab,
        attn_only=True,
        normalization_type="LN" if normalization == "layernorm" else "RMS",
        act_fn=None,
        positional_embedding_type="standard",
        dtype=torch.float64,
    )
    state = {
        "embed.W_E": model.W_E,
        "pos_embed.W_pos": model.W_pos,
        "unembed.W_U": model.W_U,
        "ln_final.w": model.final_norm.weight,
    }
    for l, layer in enumerate(model.layers):
        state |= {f"blocks.{l}.attn.{n}": getattr(layer, n) for n in ("W_Q", "W_K", "W_V", "W_O")}
        state[f"blocks.{l}.ln1.w"] = layer.norm.weight
    state = {k: v.detach().clone() for k, v in state.items()}
    folded = weight_processing.ProcessWeights.fold_layer_norm(
        state, cfg, fold_biases=False, center_weights=normalization == "layernorm"
    )
    circuits = head_circuits(model, torch.float64)
    for l in range(s.n_layers):
        for name, ours in (("W_Q", circuits.qk.left), ("W_K", circuits.qk.right), ("W_V", circuits.ov.left)):
            assert relative_error(ours[l], folded[f"blocks.{l}.attn.{name}"]) < 1e-12, (l, name)
    assert relative_error(folded_unembedding(model, torch.float64), folded["unembed.W_U"]) < 1e-12


def gain_only_circuits(model):
    """The old convention: the gain folded, not the centring (for the comparison below)."""
    fold = lambda layer, name: layer.norm.weight.detach().double()[:, None] * getattr(layer, name).detach().double()
    stack = lambda name: torch.stack([fold(layer, name) for layer in model.layers])
    W_O = torch.stack([layer.W_O.detach().double() for layer in model.layers])
    return HeadCircuits(qk=LowRank(stack("W_Q"), stack("W_K")), ov=LowRank(stack("W_V"), W_O.mT))


def test_how_much_the_centring_changes_each_measure():
    """Not a check of a value: prints (``pytest -s``) each measure's relative change, centring folded
    against the gain alone, over every scored pair and kind of a random LayerNorm model."""
    model = random_model("layernorm").double()
    tokens = make_probe_batch(0, 4, 8, 10).tokens
    with torch.no_grad():
        residual = model.run_with_cache(tokens)[1]["resid_pre"]
    measures = tuple(COMPOSITION_MEASURES)
    new = composition_of(model, measures, residual=residual, dtype=torch.float64)
    old = composition_of(model, measures, circuits=gain_only_circuits(model), residual=residual, dtype=torch.float64)
    flat = lambda by_kind: torch.cat([v[~v.isnan()] for v in by_kind.values()])
    changes = {m: (flat(new[m]) - flat(old[m])).abs() / flat(old[m]).abs() for m in measures}
    for name, rel in changes.items():
        print(
            f"{name:16s} relative change: mean {rel.mean().item():.4f}, median {rel.median().item():.4f}, max {rel.max().item():.4f}"
        )
    assert changes["frobenius"].max() > 1e-3  # the centring is not a no-op on these weights
