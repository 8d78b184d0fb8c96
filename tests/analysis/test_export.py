"""Saved weights open in TransformerLens with our logits, and a TransformerLens model scores in our
tracker as TransformerLens scores it: TransformerLens is the independent reference."""

from __future__ import annotations

import pytest
import torch

from data.probe import make_probe_batch
from metrics.snapshot import take_snapshot
from records.trajectory import TrajectoryWriter
from tests.helpers import random_model

transformer_lens = pytest.importorskip(
    "transformer_lens", reason="TransformerLens is not installed (pip install -e '.[tl]')"
)
from analysis.export import from_hooked_transformer, load_hooked_transformer  # noqa: E402

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_saved_step_opens_in_transformer_lens_with_our_logits(tmp_path, normalization, dtype):
    model = random_model(normalization).to(dtype)
    TrajectoryWriter(tmp_path / "trajectory", model.shape, {}).add(40, model.state_dict(), ["linear"])
    tl_model = load_hooked_transformer(tmp_path, 40, dtype=dtype)
    tokens = torch.randint(0, model.shape.d_vocab, (8, model.shape.n_ctx), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (tl_model(tokens) - model(tokens)).abs().max().item() <= TOLERANCE[dtype]


def test_our_snapshot_scores_a_transformer_lens_model_as_transformer_lens_does():
    torch.manual_seed(0)
    config = transformer_lens.HookedTransformerConfig(
        n_layers=2,
        n_heads=3,
        d_model=24,
        d_head=6,
        n_ctx=33,
        d_vocab=40,
        attn_only=True,
        normalization_type=None,
        dtype=torch.float64,
    )
    tl_model = transformer_lens.HookedTransformer(config)
    with torch.no_grad():
        for name, parameter in tl_model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("b_"):
                parameter.zero_()  # our model has no biases: a trained one with biases is refused (below)
    snapshot = take_snapshot(
        from_hooked_transformer(tl_model),
        make_probe_batch(0, 4, 16, 39, True),
        ("frobenius",),
        100,
        dtype=torch.float64,
    )
    theirs = tl_model.all_composition_scores("K")
    for writer in range(3):
        for reader in range(3):
            assert snapshot.composition["frobenius"]["K"][0, writer, 1, reader].item() == pytest.approx(
                theirs[0, writer, 1, reader].item(), rel=1e-10
            )


def test_transformer_lens_models_we_cannot_score_are_refused_in_one_line():
    config = transformer_lens.HookedTransformerConfig(
        n_layers=1,
        n_heads=2,
        d_model=8,
        d_head=4,
        n_ctx=5,
        d_vocab=7,
        d_mlp=16,
        act_fn="relu",
        attn_only=False,
        positional_embedding_type="rotary",
    )
    with pytest.raises(ValueError, match="MLPs .*positional_embedding_type='rotary'"):
        from_hooked_transformer(transformer_lens.HookedTransformer(config))
    layernorm = transformer_lens.HookedTransformer(
        transformer_lens.HookedTransformerConfig(
            n_layers=1, n_heads=2, d_model=8, d_head=4, n_ctx=5, d_vocab=7, attn_only=True, normalization_type="LN"
        )
    )
    with torch.no_grad():
        layernorm.blocks[0].ln1.b.fill_(0.1)
    with pytest.raises(ValueError, match="non-zero LayerNorm biases .*blocks.0.ln1.b"):
        from_hooked_transformer(layernorm)


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_shortformer_positions_and_biases_open_in_transformer_lens_with_our_logits(tmp_path, normalization):
    from tests.helpers import seed002_like

    model = seed002_like("shortformer", True, normalization)
    TrajectoryWriter(tmp_path / "trajectory", model.shape, {}).add(7, model.state_dict(), ["log"])
    tl_model = load_hooked_transformer(tmp_path, 7, dtype=torch.float64)
    assert tl_model.cfg.positional_embedding_type == "shortformer"
    tokens = torch.randint(0, model.shape.d_vocab, (4, model.shape.n_ctx), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (tl_model(tokens) - model(tokens)).abs().max().item() <= 1e-10
        back = from_hooked_transformer(tl_model)
        assert back.shape == model.shape and torch.equal(back(tokens), model(tokens))
