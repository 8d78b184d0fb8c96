"""Saved weights open in TransformerLens with our logits, and a TransformerLens model scores in our
tracker as TransformerLens scores it: TransformerLens is the independent reference."""

from __future__ import annotations

import pytest
import torch

from data.probe import make_probe_batch
from metrics.snapshot import take_snapshot
from records.trajectory import TrajectoryWriter
from tests.helpers import random_model, require_extra

transformer_lens = require_extra("transformer_lens", "tl")
from analysis.export import (  # noqa: E402
    from_hooked_transformer,
    hooked_transformer,
    load_hooked_transformer,
    new_transformer_lens_model,
    transformer_lens_major,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def tolerance(dtype: torch.dtype, normalization: str) -> float:
    """TransformerLens 4's native RMSNorm computes in float32 whatever the model's dtype
    (``sources/native/model.py``): its float64 logits are float32-close."""
    if dtype == torch.float64 and normalization == "rmsnorm" and transformer_lens_major() >= 4:
        return TOLERANCE[torch.float32]
    return TOLERANCE[dtype]


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_saved_step_opens_in_transformer_lens_with_our_logits(tmp_path, normalization, dtype):
    model = random_model(normalization).to(dtype)
    TrajectoryWriter(tmp_path / "trajectory", model.shape, {}).add(40, model.state_dict(), ["linear"])
    tl_model = load_hooked_transformer(tmp_path, 40, dtype=dtype)
    tokens = torch.randint(0, model.shape.d_vocab, (8, model.shape.n_ctx), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (tl_model(tokens) - model(tokens)).abs().max().item() <= tolerance(dtype, normalization)


@torch.no_grad()
def random_transformer_lens_model(seed: int = 0, **config):
    """A TransformerLens model of ``config`` built by TransformerLens (3 or 4), weights N(0, 0.2), biases zero."""
    torch.manual_seed(seed)
    tl_model = new_transformer_lens_model({"dtype": torch.float32, "default_prepend_bos": False, **config})
    for name, parameter in tl_model.named_parameters():
        if name.endswith(".bias") or name.rsplit(".", 1)[-1].startswith("b_"):
            parameter.zero_()  # our model has no biases: a trained one with biases is refused (below)
        else:
            parameter.normal_(0, 0.2)
    return tl_model


def test_our_snapshot_scores_a_transformer_lens_model_as_transformer_lens_does():
    tl_model = random_transformer_lens_model(
        n_layers=2,
        n_heads=3,
        d_model=24,
        d_head=6,
        n_ctx=33,
        d_vocab=40,
        attn_only=True,
        normalization_type=None,
        positional_embedding_type="standard",
        dtype=torch.float64,
    )
    snapshot = take_snapshot(
        from_hooked_transformer(tl_model),
        make_probe_batch(0, 4, 16, 39, True),
        composition={"measures": ["frobenius"], "baseline_samples": 100},
        dtype=torch.float64,
    )
    theirs = tl_model.all_composition_scores("K")
    theirs = getattr(theirs, "scores", theirs)  # TransformerLens 4: a CompositionScores holding them
    for writer in range(3):
        for reader in range(3):
            assert snapshot["composition"].scores["frobenius"]["K"][0, writer, 1, reader].item() == pytest.approx(
                theirs[0, writer, 1, reader].item(), rel=1e-10
            )


def test_transformer_lens_models_we_cannot_score_are_refused_in_one_line():
    sizes = {"n_layers": 1, "n_heads": 2, "d_model": 8, "d_head": 4, "n_ctx": 5, "d_vocab": 7}
    with_mlps = random_transformer_lens_model(
        **sizes, d_mlp=16, act_fn="relu", attn_only=False, positional_embedding_type="rotary", normalization_type=None
    )
    with pytest.raises(ValueError, match="MLPs .*positional_embedding_type='rotary'"):
        from_hooked_transformer(with_mlps)
    layernorm = random_transformer_lens_model(
        **sizes, attn_only=True, normalization_type="LN", positional_embedding_type="standard"
    )
    with torch.no_grad():
        layernorm.blocks[0].ln1.b.fill_(0.1)
    with pytest.raises(ValueError, match="non-zero LayerNorm biases .*blocks.0.ln1.b"):
        from_hooked_transformer(layernorm)


@pytest.mark.parametrize("positions", ["standard", "shortformer"])
@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_seed_002s_positions_and_biases_open_in_transformer_lens_with_our_logits(tmp_path, positions, normalization):
    """Biases, and shortformer positions in TransformerLens 3; TransformerLens 4 refuses those in one line."""
    from tests.helpers import easytransformer_like

    model = easytransformer_like(positions, True, normalization)
    TrajectoryWriter(tmp_path / "trajectory", model.shape, {}).add(7, model.state_dict(), ["log"])
    if positions == "shortformer" and transformer_lens_major() >= 4:
        with pytest.raises(ValueError, match=r"^TransformerLens 4's native model has no shortformer positions: .*<4"):
            load_hooked_transformer(tmp_path, 7, dtype=torch.float64)
        return
    tl_model = load_hooked_transformer(tmp_path, 7, dtype=torch.float64)
    assert tl_model.cfg.positional_embedding_type == positions
    tokens = torch.randint(0, model.shape.d_vocab, (4, model.shape.n_ctx), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (tl_model(tokens) - model(tokens)).abs().max().item() <= 1e-10
        back = from_hooked_transformer(tl_model)
        assert back.shape == model.shape and torch.equal(back(tokens), model(tokens))


def test_a_load_that_misses_a_weight_fails_naming_it(tmp_path):
    model = random_model("layernorm")
    state_dict = model.state_dict()
    del state_dict["layers.1.W_K"]
    with pytest.raises(ValueError, match=r"does not take these weights \(missing \['blocks\.1\.attn"):
        hooked_transformer(state_dict, model.shape)
