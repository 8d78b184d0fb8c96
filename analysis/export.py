"""Open a saved step in TransformerLens, and score a TransformerLens model with our tracker.

    python -m analysis.export RUN_DIR --step 500 --out exported/     # config.json + model.safetensors

In Python (TransformerLens installed: ``pip install -e '.[tl]'``)::

    from analysis.export import load_hooked_transformer
    tl_model = load_hooked_transformer("outputs/2026-11-23/10-00-00", step=500)
    tl_model.all_composition_scores("K")

Our model is TransformerLens's attention-only transformer with every bias zero, the same per-head
layout (``W_Q [n_heads, d_model, d_head]``, ``W_O [n_heads, d_head, d_model]``) and the same
attention scale (1/sqrt(d_head)); the key map is :data:`KEYS` (TransformerLens 3's names, which
4's ``convert_tl_checkpoint`` reads). Nothing is folded on load: the model's logits equal ours.
TransformerLens 4 (what ``pip install -e '.[tl]'`` gives) builds it with
``TransformerBridge.boot_native``; 3 with ``HookedTransformer``. TransformerLens 4's native model
has no shortformer positions: such a run opens only in 3 (one line says so).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from models.transformer import AttentionOnlyTransformer, TransformerShape
from records.layout import EXPORT_CONFIG, EXPORT_WEIGHTS
from records.trajectory import Trajectory, TrajectoryError

INSTALL_HINT = "pip install -e '.[tl]'"
NORMALIZATION_TYPES = {"none": None, "layernorm": "LN", "rmsnorm": "RMS"}
KEYS = {
    "W_E": "embed.W_E",
    "W_pos": "pos_embed.W_pos",
    "W_U": "unembed.W_U",
    "final_norm.weight": "ln_final.w",
    "layers.{l}.W_Q": "blocks.{l}.attn.W_Q",
    "layers.{l}.W_K": "blocks.{l}.attn.W_K",
    "layers.{l}.W_V": "blocks.{l}.attn.W_V",
    "layers.{l}.W_O": "blocks.{l}.attn.W_O",
    "layers.{l}.norm.weight": "blocks.{l}.ln1.w",
    "layers.{l}.b_Q": "blocks.{l}.attn.b_Q",
    "layers.{l}.b_K": "blocks.{l}.attn.b_K",
    "layers.{l}.b_V": "blocks.{l}.attn.b_V",
    "layers.{l}.b_O": "blocks.{l}.attn.b_O",
    "b_U": "unembed.b_U",
}
"""Our state-dict keys -> TransformerLens's (``{l}``: the layer)."""


def hooked_transformer_config(shape: TransformerShape, dtype: torch.dtype = torch.float32) -> dict:
    """The ``HookedTransformerConfig`` arguments of our model. RMSNorm's epsilon is torch's default
    for ``nn.RMSNorm(eps=None)``, the dtype's machine epsilon; LayerNorm's is 1e-5 in both."""
    eps = torch.finfo(dtype).eps if shape.normalization == "rmsnorm" else 1e-5
    return {
        "n_layers": shape.n_layers,
        "d_model": shape.d_model,
        "d_head": shape.d_head,
        "n_heads": shape.n_heads,
        "n_ctx": shape.n_ctx,
        "d_vocab": shape.d_vocab,
        "attn_only": True,
        "act_fn": None,
        "normalization_type": NORMALIZATION_TYPES[shape.normalization],
        "positional_embedding_type": shape.positions,
        "default_prepend_bos": False,
        "eps": eps,
        "dtype": str(dtype).removeprefix("torch."),
    }


def to_transformer_lens(state_dict: dict[str, torch.Tensor], shape: TransformerShape) -> dict[str, torch.Tensor]:
    """Our state dict in TransformerLens's names, with zeros for the biases it has and ours does not."""
    out = {}
    for ours, theirs in KEYS.items():
        for layer in range(shape.n_layers) if "{l}" in ours else [None]:
            key = ours.format(l=layer)
            if key in state_dict:
                out[theirs.format(l=layer)] = state_dict[key]
    like = state_dict["W_E"]
    zeros = lambda *size: torch.zeros(*size, dtype=like.dtype)
    for layer in range(shape.n_layers):
        for name in ("b_Q", "b_K", "b_V"):
            out.setdefault(f"blocks.{layer}.attn.{name}", zeros(shape.n_heads, shape.d_head))
        out.setdefault(f"blocks.{layer}.attn.b_O", zeros(shape.d_model))
        if shape.normalization == "layernorm":
            out[f"blocks.{layer}.ln1.b"] = zeros(shape.d_model)
    if shape.normalization == "layernorm":
        out["ln_final.b"] = zeros(shape.d_model)
    out.setdefault("unembed.b_U", zeros(shape.d_vocab))
    return out


def transformer_lens_major() -> int:
    """The installed TransformerLens's major version (3 or 4), or a one-line ImportError naming the extra."""
    try:
        return int(importlib.metadata.version("transformer-lens").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"opening a run in TransformerLens needs it: {INSTALL_HINT}") from None


def new_transformer_lens_model(config: dict):
    """An attention-only TransformerLens model of ``config`` (:func:`hooked_transformer_config`'s
    arguments; ``dtype`` a name or a ``torch.dtype``), weights not yet loaded: a
    ``TransformerBridge`` around TransformerLens 4's native model, or a 3.x ``HookedTransformer``."""
    config = {
        **config,
        "dtype": getattr(torch, config["dtype"]) if isinstance(config["dtype"], str) else config["dtype"],
    }
    if transformer_lens_major() < 4:
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        return HookedTransformer(HookedTransformerConfig(**config))
    if config["positional_embedding_type"] == "shortformer":
        raise ValueError(
            "TransformerLens 4's native model has no shortformer positions: this model opens in"
            " TransformerLens 3 (pip install 'transformer-lens>=2,<4')"
        )
    from transformer_lens import TransformerBridge, TransformerBridgeConfig
    from transformer_lens.model_bridge.sources import native  # noqa: F401  (attaches boot_native)

    # act_fn and d_mlp: unused by an attention-only model, but typed fields; init_weights=False: ours come next
    mlp = {"act_fn": config.get("act_fn") or "relu", "d_mlp": config.get("d_mlp") or 4 * config["d_model"]}
    bridge_config = TransformerBridgeConfig(**{**config, **mlp, "init_weights": False, "device": "cpu"})
    return TransformerBridge.boot_native(bridge_config, dtype=config["dtype"])


def load_transformer_lens_weights(tl_model, weights: dict[str, torch.Tensor]) -> None:
    """Load ``weights`` (TransformerLens 3's names, :func:`to_transformer_lens`) into ``tl_model``;
    a weight missing or left over is a ValueError naming it (their causal-mask buffers aside)."""
    if transformer_lens_major() >= 4:  # its load_state_dict reports missing keys by internal paths
        from transformer_lens.utilities.tl_checkpoint_conversion import convert_tl_checkpoint

        weights = convert_tl_checkpoint(weights, tl_model.cfg)
        wanted = set(tl_model.state_dict())
        missing, unexpected = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
    else:
        missing, unexpected = tl_model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith((".mask", ".IGNORE"))]
    if missing or unexpected:
        raise ValueError(
            f"TransformerLens's model does not take these weights (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if transformer_lens_major() >= 4:
        tl_model.load_state_dict(weights, strict=True)


def hooked_transformer(
    state_dict: dict[str, torch.Tensor],
    shape: TransformerShape,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """A TransformerLens model holding ``state_dict`` (ours), in ``dtype``, in eval mode."""
    tl_model = new_transformer_lens_model(hooked_transformer_config(shape, dtype))
    load_transformer_lens_weights(tl_model, {k: v.to(dtype) for k, v in to_transformer_lens(state_dict, shape).items()})
    return tl_model.to(device, print_details=False).eval()


def load_hooked_transformer(
    run_dir: str | Path, step: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """The saved weights of ``run_dir`` at ``step`` as a TransformerLens model."""
    trajectory = Trajectory(run_dir)
    return hooked_transformer(trajectory.state_dict(step), trajectory.shape, dtype, device)


def load_exported(directory: str | Path, device: str | torch.device = "cpu"):
    """The TransformerLens model that ``python -m analysis.export`` wrote into ``directory``."""
    tl_model = new_transformer_lens_model(json.loads((Path(directory) / EXPORT_CONFIG).read_text()))
    load_transformer_lens_weights(tl_model, load_file(str(Path(directory) / EXPORT_WEIGHTS)))
    return tl_model.to(device, print_details=False).eval()


def transformer_lens_weights(tl_model) -> dict[str, torch.Tensor]:
    """``tl_model``'s weights in TransformerLens 3's names (:data:`KEYS`' values), read through the
    accessors both 3 and 4 have (4's ``state_dict`` names its ``nn.Linear`` projections instead)."""
    cfg = tl_model.cfg
    weights = {KEYS[name]: getattr(tl_model, name) for name in ("W_E", "W_pos", "W_U", "b_U")}
    for layer, block in enumerate(tl_model.blocks):
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
            weights[KEYS[f"layers.{{l}}.{name}"].format(l=layer)] = getattr(block.attn, name)
        if cfg.normalization_type is not None:
            weights[f"blocks.{layer}.ln1.w"] = block.ln1.w
            if cfg.normalization_type == "LN":
                weights[f"blocks.{layer}.ln1.b"] = block.ln1.b
    if cfg.normalization_type is not None:
        weights["ln_final.w"] = tl_model.ln_final.w
        if cfg.normalization_type == "LN":
            weights["ln_final.b"] = tl_model.ln_final.b
    return {key: value.detach() for key, value in weights.items()}


@torch.no_grad()
def from_hooked_transformer(tl_model) -> AttentionOnlyTransformer:
    """Our model with the weights of an attention-only ``HookedTransformer`` (trained anywhere), so
    that :func:`metrics.snapshot.take_snapshot` can score it; with biases where any of its attention
    or unembedding biases is not zero. Refused, one line each: MLPs, positions other than "standard"
    and "shortformer", a normalization we do not have, a LayerNorm bias that is not zero (ours has none)."""
    cfg = tl_model.cfg
    normalization = {v: k for k, v in NORMALIZATION_TYPES.items()}.get(cfg.normalization_type)
    problems = [
        what
        for what, bad in (
            ("it has MLPs (attn_only=False)", not cfg.attn_only),
            (
                f"positional_embedding_type={cfg.positional_embedding_type!r} (we have 'standard', 'shortformer')",
                cfg.positional_embedding_type not in ("standard", "shortformer"),
            ),
            (
                f"normalization_type={cfg.normalization_type!r} (we have None, 'LN', 'RMS')",
                cfg.normalization_type not in NORMALIZATION_TYPES.values(),
            ),
        )
        if bad
    ]
    theirs = transformer_lens_weights(tl_model) if not problems else {}
    nonzero = lambda names: [k for k, v in theirs.items() if k.rsplit(".", 1)[-1] in names and v.abs().max() > 0]
    if nonzero(("b",)):
        problems.append(f"non-zero LayerNorm biases ({', '.join(nonzero(('b',))[:3])}): our LayerNorm has none")
    if problems:
        raise ValueError(f"cannot score this TransformerLens model: {'; '.join(problems)}")
    biases = bool(nonzero(("b_Q", "b_K", "b_V", "b_O", "b_U")))
    shape = TransformerShape(
        cfg.n_layers,
        cfg.n_heads,
        cfg.d_model,
        cfg.d_head,
        cfg.n_ctx,
        cfg.d_vocab,
        normalization,
        cfg.positional_embedding_type,
        biases,
    )
    with torch.device("meta"):
        model = AttentionOnlyTransformer(shape)
    ours, wanted = {}, set(model.state_dict())
    for mine, tl_key in KEYS.items():
        for layer in range(shape.n_layers) if "{l}" in mine else [None]:
            if mine.format(l=layer) in wanted:
                ours[mine.format(l=layer)] = (
                    theirs[tl_key.format(l=layer)].detach().clone(memory_format=torch.contiguous_format)
                )
    model.load_state_dict(ours, assign=True)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a saved step of a run as a TransformerLens model (config.json + model.safetensors)."
    )
    parser.add_argument("run_dir", type=Path, help="a train.py run directory with trajectory/")
    parser.add_argument("--step", type=int, required=True, help="a saved step (see RUN_DIR/trajectory/index.json)")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty directory")
    args = parser.parse_args(argv)
    try:
        trajectory = Trajectory(args.run_dir)
        state_dict = trajectory.state_dict(args.step)
    except TrajectoryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        print(f"error: {args.out} exists and is not an empty directory: nothing written", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = state_dict["W_E"].dtype
    weights = {k: v.contiguous() for k, v in to_transformer_lens(state_dict, trajectory.shape).items()}
    save_file(weights, str(args.out / EXPORT_WEIGHTS), metadata={"step": str(args.step), "run_dir": str(args.run_dir)})
    (args.out / EXPORT_CONFIG).write_text(json.dumps(hooked_transformer_config(trajectory.shape, dtype), indent=1))
    print(
        f"wrote {args.out / EXPORT_CONFIG} and {args.out / EXPORT_WEIGHTS} (step {args.step});"
        f" open with analysis.export.load_exported({str(args.out)!r})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
