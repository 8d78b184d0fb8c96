"""Folding the normalization into the reading weights, and centring the writing ones
(docs/measures.md, "Folding normalization").

LayerNorm without bias is ``LN(x) = (x - mean(x)) / s(x) · g`` with ``s(x) = sqrt(var(x) + eps)``:
the centring ``x -> x C`` (``C = I - 11ᵀ/d_model``) and the gain are linear, so a weight ``W`` that
reads ``LN(x)`` reads ``x / s(x)`` through ``C diag(g) W``. RMSNorm has no centring: ``diag(g) W``.
Under LayerNorm the writers' rows are centred, ``W_O C``. Checked against a TransformerLens-style
fold written out by hand, against TransformerLens's own ``ProcessWeights.fold_layer_norm`` and
``center_writing_weights`` (slow: the import takes 10-20 s), and against the model's own forward pass.
"""

from __future__ import annotations

import pytest
import torch

from bench.reparametrize import ones_shift
from data.probe import make_probe_batch
from metrics.composition.circuits import HeadCircuits, LowRank, centre_writing, head_circuits
from metrics.composition.engine import composition_scores
from metrics.composition.measures import WEIGHT_MEASURES, frobenius_ratio
from metrics.composition.scores import composition_of
from metrics.composition.whitening import Whitening, embedding_covariance, residual_covariance, token_gram
from metrics.heads.circuit_scores import folded_unembedding
from metrics.snapshot import take_snapshot
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import easytransformer_like, random_model, require_extra


def transformerlens_fold(model):
    """``(W_Q, W_K, W_V, W_O, W_U)`` in float64, folded as TransformerLens's ``fold_layer_norm(...,
    fold_biases=False, center_weights=True)`` does for LayerNorm: multiply by the gain over d_model,
    then subtract the mean over d_model (``"head_index d_model d_head -> head_index 1 d_head"``); the
    unembedding likewise (its d_model axis is 0); ``W_O`` as its ``center_writing_weights`` does,
    ``W_O - W_O.mean(-1, keepdim=True)``. No centring under RMSNorm or without a norm."""

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
    if isinstance(model.final_norm, torch.nn.LayerNorm):
        W_O = W_O - W_O.mean(-1, keepdim=True)
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


def test_centred_weights_ignore_the_ones_direction():
    """Under LayerNorm every folded reading weight annihilates ``1`` (what the centring removes) and
    every writing weight writes nothing along it (``W_O``; each row sums to 0); under RMSNorm neither
    (nothing is centred)."""
    ones = lambda model: torch.ones(model.shape.d_model, dtype=torch.float64)
    ln = random_model("layernorm")
    circuits = head_circuits(ln, torch.float64)
    for factor in (circuits.qk.left, circuits.qk.right, circuits.ov.left, circuits.ov.right):
        assert (ones(ln) @ factor).abs().max() < 1e-12
    assert (ones(ln) @ folded_unembedding(ln, torch.float64)).abs().max() < 1e-12
    rms = random_model("rmsnorm")
    circuits = head_circuits(rms, torch.float64)
    for factor in (circuits.qk.left, circuits.qk.right, circuits.ov.left, circuits.ov.right):
        assert (ones(rms) @ factor).abs().max() > 1e-2
    assert (ones(rms) @ folded_unembedding(rms, torch.float64)).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm"])
def test_fold_equals_transformerlens_fold_layer_norm(normalization):
    """TransformerLens's own ``ProcessWeights.fold_layer_norm`` on the model's weights in its
    state-dict layout, ``center_weights`` for LayerNorm only (as its docstring says for RMSNorm), then
    under LayerNorm its ``center_writing_weights`` (``W_O``, ``W_E``, ``W_pos``)."""
    weight_processing = require_extra("transformer_lens.weight_processing", "tl")
    transformer_lens = require_extra("transformer_lens", "tl")
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
    if normalization == "layernorm":
        folded = weight_processing.ProcessWeights.center_writing_weights(folded, cfg)
    circuits = head_circuits(model, torch.float64)
    for l in range(s.n_layers):
        for name, ours in (("W_Q", circuits.qk.left), ("W_K", circuits.qk.right), ("W_V", circuits.ov.left)):
            assert relative_error(ours[l], folded[f"blocks.{l}.attn.{name}"]) < 1e-12, (l, name)
        assert relative_error(circuits.ov.right[l].mT, folded[f"blocks.{l}.attn.W_O"]) < 1e-12, (l, "W_O")
    assert relative_error(folded_unembedding(model, torch.float64), folded["unembed.W_U"]) < 1e-12
    for name in ("W_E", "W_pos"):  # what the whitening covariances and token-space scores read
        ours = centre_writing(model.final_norm, getattr(model, name), torch.float64)
        assert relative_error(ours, folded[f"{'embed' if name == 'W_E' else 'pos_embed'}.{name}"]) < 1e-12, name


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
    measures = tuple(WEIGHT_MEASURES)
    new = composition_of(model, measures, residual=residual, dtype=torch.float64)
    old = composition_of(model, measures, circuits=gain_only_circuits(model), residual=residual, dtype=torch.float64)
    flat = lambda by_kind: torch.cat([v[~v.isnan()] for v in by_kind.values()])
    changes = {m: (flat(new[m]) - flat(old[m])).abs() / flat(old[m]).abs() for m in measures}
    for name, rel in changes.items():
        print(
            f"{name:16s} relative change: mean {rel.mean().item():.4f}, median {rel.median().item():.4f}, max {rel.max().item():.4f}"
        )
    assert changes["frobenius"].max() > 1e-3  # the centring is not a no-op on these weights


def snapshot_scores(model, probe) -> dict[str, torch.Tensor]:
    """Every weight-based score of a float64 snapshot, flattened: each composition measure (every
    scored pair, kinds Q, K, V), the matching score of every pair, the weight and empirical copying
    scores of every head."""
    composition = {"measures": list(WEIGHT_MEASURES), "baseline_samples": 50}
    snap = take_snapshot(model, probe, composition=composition, matching=True, writes=True, dtype=torch.float64)
    flat = lambda t: t[~t.isnan()]
    scores = {m: torch.cat([flat(v) for v in by_kind.values()]) for m, by_kind in snap["composition"].scores.items()}
    writes = snap["writes"]
    scores |= {"match": flat(snap["matching"]), "ov_copying": writes.score("ov_copying").flatten()}
    return scores | {
        "copying": writes.score("copying").flatten(),
        "successor": writes.score("successor").flatten(),
    }


def shifts(model, writer: str, generator) -> dict[str, torch.Tensor]:
    """Random constants, one a row of ``writer`` (``ones_shift``'s arguments), about 2x each weight's spread."""
    s = model.shape
    draw = lambda *shape, w: 2 * float(w.detach().std()) * torch.randn(*shape, generator=generator, dtype=torch.float64)
    W_O = model.layers[0].W_O
    if writer == "W_O of one head":  # L0H1, as in issue #30's measurement
        one = torch.zeros(s.n_layers, s.n_heads, s.d_head, dtype=torch.float64)
        one[0, 1] = draw(s.d_head, w=W_O)
        return {"W_O": one}
    if writer == "W_O of every head":
        return {"W_O": draw(s.n_layers, s.n_heads, s.d_head, w=W_O)}
    if writer == "W_E":
        return {"W_E": draw(s.d_vocab, w=model.W_E)}
    return {"W_pos": draw(s.n_ctx, w=model.W_pos)}


def layernorm_model(seed: int = 0):
    """3 layers x 3 heads, d_model 24, d_vocab 40 (the token Gram has full rank on ``1⊥``: token space
    is well defined), random gains, float64."""
    torch.manual_seed(seed)
    model = AttentionOnlyTransformer(TransformerShape(3, 3, 24, 5, 17, 40, "layernorm")).double()
    with torch.no_grad():
        for norm in [*(layer.norm for layer in model.layers), model.final_norm]:
            norm.weight.uniform_(0.5, 1.5)
    return model


def assert_same_logits_and_scores(model, shifted, probe, label: str) -> None:
    """``shifted`` gives ``model``'s logits on ``probe`` to float64 rounding, and every score of a snapshot."""
    with torch.no_grad():
        logits = model(probe.tokens)
        assert (shifted(probe.tokens) - logits).abs().max() < 1e-12 * logits.abs().max()
    before, after = snapshot_scores(model, probe), snapshot_scores(shifted, probe)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-10, atol=1e-12, msg=f"{label}: {name}")


@pytest.mark.parametrize("writer", ["W_O of one head", "W_O of every head", "W_E", "W_pos"])
def test_a_write_along_the_ones_direction_moves_no_logit_and_no_score(writer):
    """Under LayerNorm every reader sees ``x C`` only (``LN(x + a1) = LN(x)``): adding a constant to
    every entry of a writer's row (a constant per row) is the same model, to float64 rounding, and
    every score computed from it, each composition measure of every pair and kind, the matching and
    copying scores, is unchanged as well: the writers are centred."""
    model = layernorm_model()
    shifted = ones_shift(model, **shifts(model, writer, torch.Generator().manual_seed(5)))
    assert_same_logits_and_scores(model, shifted, make_probe_batch(0, 4, 8, 10), writer)


def test_with_shortformer_positions_and_biases_the_tokens_heads_and_biases_shift_freely():
    """Seed 002's options under LayerNorm: the stream holds the tokens and every head's write and
    ``b_O`` (the positions join the queries' and keys' input after the norm, so ``W_pos`` is no
    writer). Shifting all of them along ``1`` changes no logit and no score (``b_O`` reaches the
    scores through the observed stream ``whitened_resid`` whitens by)."""
    model = easytransformer_like("shortformer", True, "layernorm")
    g = torch.Generator().manual_seed(2)
    shifted = ones_shift(model, **shifts(model, "W_O of every head", g), **shifts(model, "W_E", g))
    with torch.no_grad():
        for layer in shifted.layers:
            layer.b_O.add_(torch.randn(1, generator=g, dtype=torch.float64))
    probe = make_probe_batch(0, 4, 4, 10)
    assert_same_logits_and_scores(model, shifted, probe, "W_O, W_E and b_O")
    # W_pos is no writer here: a shift along 1 reaches the queries and keys, so the model changes
    moved = ones_shift(model, **shifts(model, "W_pos", g))
    with torch.no_grad():
        assert (moved(probe.tokens) - model(probe.tokens)).abs().max() > 1e-3


@pytest.mark.parametrize("normalization", ["rmsnorm", "none"])
def test_without_layernorm_a_write_along_the_ones_direction_is_another_model(normalization):
    """Why only LayerNorm centres the writers: ``rms(x + a1) != rms(x)``, and without a norm every
    reader reads ``1``; the same shift changes the logits, and the scores see it."""
    model = random_model(normalization).double()
    shifted = ones_shift(model, **shifts(model, "W_O of every head", torch.Generator().manual_seed(5)))
    probe = make_probe_batch(0, 4, 8, 10)
    with torch.no_grad():
        assert (shifted(probe.tokens) - model(probe.tokens)).abs().max() > 1e-3
    before, after = snapshot_scores(model, probe), snapshot_scores(shifted, probe)
    assert (after["frobenius"] - before["frobenius"]).abs().max() > 1e-3


def test_the_ones_direction_of_a_centred_covariance_is_filled_and_changes_no_score():
    """Under LayerNorm each whitening Σ is of centred rows, so ``Σ 1 = 0``; it is filled with the mean
    of the other eigenvalues (κ stays that of Σ on ``1⊥``), and any other positive value there gives
    the same scores: no centred weight reads or writes along ``1``. (Every Σ of this model has full
    rank on ``1⊥``, so no score depends on the eigenvalue floor.)"""
    model = layernorm_model()
    probe = make_probe_batch(0, 4, 8, 10)
    with torch.no_grad():
        residual = model.run_with_cache(probe.tokens)[1]["resid_pre"]
    d = model.shape.d_model
    ones = torch.full((d,), d**-0.5, dtype=torch.float64)
    measures = {"embedding": "whitened", "token": "token_space", "residual": "whitened_resid"}
    for basis, measure in measures.items():
        covariance = {
            "embedding": embedding_covariance(model, torch.float64),
            "token": token_gram(model, torch.float64),
            "residual": residual_covariance(residual, torch.float64, model.final_norm),
        }[basis]
        filled = ones @ covariance @ ones
        others = (covariance.trace() - filled) / (d - 1)
        assert filled == pytest.approx(others.item(), rel=1e-12)  # λ̄ along 1 ...
        assert (covariance @ ones - filled * ones).abs().max() < 1e-12  # ... an eigenvector
        plain = composition_of(model, (measure,), residual=residual, dtype=torch.float64)[measure]
        other = Whitening.of(covariance - 0.9 * filled * torch.outer(ones, ones))  # λ_max, and the floor, unmoved
        scaled = composition_of(model, (measure,), residual=residual, dtype=torch.float64, whitenings={basis: other})[
            measure
        ]
        for kind in "QKV":
            torch.testing.assert_close(scaled[kind], plain[kind], rtol=1e-9, atol=0, equal_nan=True, msg=measure)
