"""An attention-only transformer in plain torch, with per-head weights in TransformerLens layout.

Row-vector convention (see docs/measures.md): a residual vector is a row ``x [1, d_model]``, a head
reads with ``x @ W_Q[h]`` and writes ``z @ W_O[h]``. No biases and no MLPs, as in the toy models
of Elhage et al. 2021 ("A Mathematical Framework for Transformer Circuits"), so every circuit of
the model is a product of the weight matrices below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import einsum
from torch import Tensor, nn

NORMALIZATIONS = ("none", "layernorm", "rmsnorm")


@dataclass(frozen=True)
class TransformerShape:
    """Sizes of an attention-only transformer."""

    n_layers: int = 2
    n_heads: int = 4
    d_model: int = 64
    d_head: int = 16
    n_ctx: int = 64
    d_vocab: int = 64
    normalization: str = "none"

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        for name in ("n_layers", "n_heads", "d_model", "d_head", "n_ctx", "d_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def parameter_count(self) -> int:
        """Weights of the model: embeddings, ``W_Q, W_K, W_V, W_O`` per layer, norm gains, unembedding."""
        d, gains = self.d_model, self.d_model * (self.normalization != "none")
        per_layer = 4 * self.n_heads * d * self.d_head + gains
        return self.d_vocab * d + self.n_ctx * d + self.n_layers * per_layer + gains + d * self.d_vocab


def make_norm(kind: str, d_model: int) -> nn.Module:
    """Pre-attention normalization with a gain and no bias, so the gain (and LayerNorm's centring)
    folds into reading weights."""
    if kind == "layernorm":
        return nn.LayerNorm(d_model, bias=False)
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model)
    return nn.Identity()


def norm_gain(norm: nn.Module) -> Tensor | None:
    """The elementwise gain ``[d_model]`` of a normalization module, or None for no normalization."""
    return None if isinstance(norm, nn.Identity) else norm.weight


def norm_centres(norm: nn.Module) -> bool:
    """Whether a normalization module subtracts the mean over ``d_model`` (LayerNorm; not RMSNorm)."""
    return isinstance(norm, nn.LayerNorm)


class AttentionLayer(nn.Module):
    """One layer of ``n_heads`` causal attention heads, added into the residual stream.

    Weights: ``W_Q, W_K, W_V [n_heads, d_model, d_head]``, ``W_O [n_heads, d_head, d_model]``.
    """

    def __init__(self, shape: TransformerShape) -> None:
        super().__init__()
        h, d, e = shape.n_heads, shape.d_model, shape.d_head
        self.norm = make_norm(shape.normalization, d)
        self.W_Q = nn.Parameter(torch.randn(h, d, e) / math.sqrt(d))
        self.W_K = nn.Parameter(torch.randn(h, d, e) / math.sqrt(d))
        self.W_V = nn.Parameter(torch.randn(h, d, e) / math.sqrt(d))
        self.W_O = nn.Parameter(torch.randn(h, e, d) / math.sqrt(e * h))

    def project(self, x: Tensor, weight: Tensor) -> Tensor:
        """``[batch, pos, d_model] x [n_heads, d_model, d_head] -> [batch, n_heads, pos, d_head]``."""
        return einsum(self.norm(x), weight, "b t d, h d e -> b h t e")

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ``[batch, n_heads, pos, d_head]`` each, from one 2-D GEMM
        ``[b·t, d_model] @ [d_model, 3·h·e]`` (faster for the tracker's no-grad probe pass than a
        batched matmul per head; no faster in training, measured)."""
        b, t, d = x.shape
        weights = torch.cat([self.W_Q, self.W_K, self.W_V]).permute(1, 0, 2).reshape(d, -1)  # (d, 3h e)
        out = (self.norm(x).reshape(b * t, d) @ weights).view(b, t, -1, weights.shape[-1] // (3 * self.W_Q.shape[0]))
        return out.transpose(1, 2).chunk(3, dim=1)  # 3 x (b, h, t, e)

    def forward(self, x: Tensor) -> Tensor:
        """Training path through ``scaled_dot_product_attention``: ``[b, t, d] -> [b, t, d]``."""
        q, k, v = (self.project(x, w) for w in (self.W_Q, self.W_K, self.W_V))  # (b, h, t, e)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, t, e)
        return x + einsum(z, self.W_O, "b h t e, h e d -> b t d")

    def pattern(self, x_query: Tensor, x_key: Tensor | None = None) -> Tensor:
        """Explicit causal attention pattern ``[batch, n_heads, query_pos, key_pos]``.

        ``x_key`` (default: ``x_query``) is the residual stream the keys read, so a caller can
        change the keys' input alone, e.g. for a K-only path ablation.
        """
        x_key = x_query if x_key is None else x_key
        return causal_pattern(self.project(x_query, self.W_Q), self.project(x_key, self.W_K))

    def head_outputs(self, x: Tensor, pattern: Tensor) -> Tensor:
        """Each head's write into the residual stream, ``[batch, n_heads, pos, d_model]``."""
        return (pattern @ self.project(x, self.W_V)) @ self.W_O[None]


def causal_pattern(q: Tensor, k: Tensor) -> Tensor:
    """Softmax of ``q kᵀ / sqrt(d_head)`` under a causal mask: ``[b, h, t, e] x2 -> [b, h, t, t]``."""
    scores = q @ k.mT / math.sqrt(q.shape[-1])  # (b, h, t_query, t_key)
    t = scores.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)


class AttentionOnlyTransformer(nn.Module):
    """Token + learned positional embeddings, ``n_layers`` attention layers, (norm), unembedding.

    ``W_E [d_vocab, d_model]``, ``W_pos [n_ctx, d_model]``, ``W_U [d_model, d_vocab]``.
    """

    def __init__(self, shape: TransformerShape, init_std: float | None = None) -> None:
        """``init_std``: draw every weight matrix from N(0, init_std²) (the old library default of
        0.02 that seed 002 trained with) instead of 1/sqrt(fan-in); norm gains stay 1."""
        super().__init__()
        self.shape = shape
        d = shape.d_model
        self.W_E = nn.Parameter(torch.randn(shape.d_vocab, d) / math.sqrt(d))
        self.W_pos = nn.Parameter(torch.randn(shape.n_ctx, d) / math.sqrt(d))
        self.layers = nn.ModuleList(AttentionLayer(shape) for _ in range(shape.n_layers))
        self.final_norm = make_norm(shape.normalization, d)
        self.W_U = nn.Parameter(torch.randn(d, shape.d_vocab) / math.sqrt(d))
        if init_std is not None:
            with torch.no_grad():
                for name, weight in self.named_parameters():
                    if name.rsplit(".", 1)[-1].startswith("W_"):
                        weight.normal_(0.0, init_std)

    def embed(self, tokens: Tensor) -> Tensor:
        """``[batch, pos]`` token ids -> residual stream ``[batch, pos, d_model]``."""
        if tokens.shape[-1] > self.shape.n_ctx:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds n_ctx={self.shape.n_ctx}")
        return self.W_E[tokens] + self.W_pos[: tokens.shape[-1]]

    def unembed(self, x: Tensor) -> Tensor:
        """Residual stream ``[batch, pos, d_model]`` -> logits ``[batch, pos, d_vocab]``."""
        return self.final_norm(x) @ self.W_U

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[batch, pos, d_vocab]`` for ``tokens [batch, pos]`` (fast training path)."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.unembed(x)

    def run_with_cache(self, tokens: Tensor, head_out: bool = True) -> tuple[Tensor, dict[str, list[Tensor]]]:
        """Logits plus what the metrics read, computed with explicit attention patterns.

        Returns ``(logits [b, t, d_vocab], cache)`` where ``cache["resid_pre"][l]`` is layer l's
        input ``[b, t, d_model]``, ``cache["pattern"][l]`` its attention ``[b, h, t, t]`` and, with
        ``head_out``, ``cache["head_out"][l]`` each head's write ``[b, h, t, d_model]``. The stream
        itself adds the heads' writes as one GEMM over ``(head, d_head)``: without ``head_out`` the
        pass costs about a forward pass, with it (``h`` times the write's memory) up to twice that.
        """
        cache: dict[str, list[Tensor]] = {"resid_pre": [], "pattern": [], **({"head_out": []} if head_out else {})}
        x = self.embed(tokens)
        for layer in self.layers:
            q, k, v = layer.qkv(x)  # (b, h, t, e) each
            pattern = causal_pattern(q, k)  # (b, h, t, t)
            z = pattern @ v  # (b, h, t, e)
            cache["resid_pre"].append(x)
            cache["pattern"].append(pattern)
            if head_out:
                cache["head_out"].append(z @ layer.W_O[None])  # (b, h, t, d_model)
            x = x + einsum(z, layer.W_O, "b h t e, h e d -> b t d")
        return self.unembed(x), cache
