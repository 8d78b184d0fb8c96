"""An attention-only transformer in plain torch, with per-head weights in TransformerLens layout.

Row-vector convention (see docs/measures.md): a residual vector is a row ``x [1, d_model]``, a head
reads with ``x @ W_Q[h]`` and writes ``z @ W_O[h]``. No MLPs and, by default, no biases, as in the toy
models of Elhage et al. 2021 ("A Mathematical Framework for Transformer Circuits"), so every circuit of
the model is a product of the weight matrices below.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from einops import einsum
from torch import Tensor, nn

from models import forward
from models.attention import causal_pattern
from models.interventions import HeadChange, attend

Normalization = Literal["none", "layernorm", "rmsnorm"]
Positions = Literal["standard", "shortformer"]
InitScheme = Literal["fan_in", "normal", "gpt2"]
NORMALIZATIONS: tuple[Normalization, ...] = get_args(Normalization)
POSITIONS: tuple[Positions, ...] = get_args(Positions)
"""Where the learned positions enter: the residual stream (``standard``), or only the inputs of the
queries and keys (``shortformer``, Press et al. 2021; EasyTransformer's option, which aslvrstn 2022's run used)."""
INITS: tuple[InitScheme, ...] = get_args(InitScheme)
"""Weight initialisations: N(0, 1/fan-in); N(0, init_std²) for every ``W_*``; EasyTransformer's
"gpt2" mode, N(0, (0.8/sqrt(d_model))²) for every ``W_*``. Biases start at 0 and norm gains at 1."""


@dataclass(frozen=True)
class TransformerShape:
    """Sizes and options of an attention-only transformer. The sizes have no defaults (the config's
    schema, ``conf/schema.py``, holds the project's); the options default to the plain model, as the
    schema does (tests/conf/test_config.py checks they agree), so a shape saved before an option existed
    still loads."""

    n_layers: int
    n_heads: int
    d_model: int
    d_head: int
    n_ctx: int
    d_vocab: int
    normalization: Normalization = "none"
    positions: Positions = "standard"
    biases: bool = False  # b_Q, b_K, b_V [n_heads, d_head] and b_O [d_model] per layer, b_U [d_vocab]

    def __post_init__(self) -> None:
        if problems := self.check(**dataclasses.asdict(self)):
            raise ValueError("; ".join(problems))

    @staticmethod
    def check(**fields) -> list[str]:
        """Every problem of these sizes and options at once, one sentence each naming the field."""
        problems = [
            f"{name}={fields[name]} must be >= 1"
            for name in ("n_layers", "n_heads", "d_model", "d_head", "n_ctx", "d_vocab")
            if fields[name] < 1
        ]
        if fields["d_head"] > fields["d_model"]:
            problems.append(f"d_head={fields['d_head']} must be <= d_model={fields['d_model']}")
        if fields.get("normalization", "none") not in NORMALIZATIONS:
            problems.append(f"normalization={fields['normalization']!r} must be one of {NORMALIZATIONS}")
        if fields.get("positions", "standard") not in POSITIONS:
            problems.append(f"positions={fields['positions']!r} must be one of {POSITIONS}")
        return problems

    @property
    def parameter_count(self) -> int:
        """Weights of the model: embeddings, ``W_Q, W_K, W_V, W_O`` per layer, norm gains, biases, unembedding."""
        d, gains = self.d_model, self.d_model * (self.normalization != "none")
        layer_biases, unembed_bias = (3 * self.n_heads * self.d_head + d, self.d_vocab) if self.biases else (0, 0)
        per_layer = 4 * self.n_heads * d * self.d_head + gains + layer_biases
        return self.d_vocab * d + self.n_ctx * d + self.n_layers * per_layer + gains + d * self.d_vocab + unembed_bias


def init_problems(init: str, init_std: float | None) -> list[str]:
    """What is wrong with an initialisation (:data:`INITS`; ``init_std`` goes with ``normal`` alone, > 0)."""
    if init not in INITS:
        return [f"init={init!r} must be one of {INITS}"]
    if init == "normal" and (init_std is None or not math.isfinite(init_std) or init_std <= 0):
        return [f"init=normal needs init_std > 0 (got {init_std})"]
    if init != "normal" and init_std is not None:
        return [f"init_std={init_std} goes with init=normal (init={init})"]
    return []


def make_norm(kind: Normalization, d_model: int, device=None) -> nn.Module:
    """Pre-attention normalization with a gain and no bias, so the gain (and LayerNorm's centring)
    folds into reading weights."""
    if kind == "layernorm":
        return nn.LayerNorm(d_model, bias=False, device=device)
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model, device=device)
    return nn.Identity()


def norm_gain(norm: nn.Module) -> Tensor | None:
    """The elementwise gain ``[d_model]`` of a normalization module, or None for no normalization."""
    return None if isinstance(norm, nn.Identity) else norm.weight


def norm_centres(norm: nn.Module) -> bool:
    """Whether a normalization module subtracts the mean over ``d_model`` (LayerNorm; not RMSNorm)."""
    return isinstance(norm, nn.LayerNorm)


class AttentionLayer(nn.Module):
    """One layer of ``n_heads`` causal attention heads, added into the residual stream.

    Weights: ``W_Q, W_K, W_V [n_heads, d_model, d_head]``, ``W_O [n_heads, d_head, d_model]``; with
    ``shape.biases`` also ``b_Q, b_K, b_V [n_heads, d_head]`` and ``b_O [d_model]`` (else None).
    ``pos [pos, d_model]`` (shortformer positions) is added to the normalized input of the queries
    and keys only, never to the values or the stream, as TransformerLens's ``shortformer`` does
    (``ln1(x) + pos``: the norm never sees the positions).

    ``changes``: the interventions on this layer's heads now active (``models/interventions.py``),
    set by :meth:`AttentionOnlyTransformer.set_changes`; without any, training takes the fused path.

    The layer holds the weights; the model's pass through it is :func:`models.forward.attention_layer`.
    Its methods are the explicit path the metrics read (queries, keys, patterns, each head's write).
    """

    def __init__(self, shape: TransformerShape, device=None) -> None:
        super().__init__()
        h, d, e = shape.n_heads, shape.d_model, shape.d_head
        self.normalization = shape.normalization
        self.norm = make_norm(shape.normalization, d, device)
        self.W_Q = nn.Parameter(torch.randn(h, d, e, device=device) / math.sqrt(d))
        self.W_K = nn.Parameter(torch.randn(h, d, e, device=device) / math.sqrt(d))
        self.W_V = nn.Parameter(torch.randn(h, d, e, device=device) / math.sqrt(d))
        self.W_O = nn.Parameter(torch.randn(h, e, d, device=device) / math.sqrt(e * h))
        for name, size in (("b_Q", (h, e)), ("b_K", (h, e)), ("b_V", (h, e)), ("b_O", (d,))):
            self.register_parameter(name, nn.Parameter(torch.zeros(size, device=device)) if shape.biases else None)
        self.changes: tuple[HeadChange, ...] = ()

    @property
    def reads_affinely(self) -> bool:
        """Whether its queries, keys and values are affine in the stream (no normalization between):
        then a change ``Δ`` of the stream moves them by :meth:`linear_keys` / :meth:`linear_qkv` of ``Δ``."""
        return isinstance(self.norm, nn.Identity)

    def normalize(self, x: Tensor) -> Tensor:
        """The layer's normalization of ``x [..., d_model]`` (:func:`models.forward.normalize`)."""
        return forward.normalize(x, self.normalization, norm_gain(self.norm))

    def project(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, pos: Tensor | None = None) -> Tensor:
        """``norm(x) (+ pos) [..., t, d_model]`` read by per-head ``weight [h, d_model, d_head]`` (plus
        ``bias [h, d_head]``) -> ``[..., h, t, d_head]`` (:func:`models.forward.project`)."""
        read = self.normalize(x)
        return forward.project(read if pos is None else read + pos, weight, bias)

    def qkv(self, x: Tensor, pos: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values ``[..., n_heads, t, d_head]`` each of ``x [..., t, d_model]``: one
        normalization and one GEMM (faster for a no-grad pass than a matmul per weight); two GEMMs with
        shortformer positions ``pos [t, d_model]``, which only the queries and keys read."""
        read = self.normalize(x)
        if pos is None:
            weights, biases = torch.cat([self.W_Q, self.W_K, self.W_V]), self._biases("b_Q", "b_K", "b_V")
            return forward.project(read, weights, biases).chunk(3, dim=-3)
        qk = forward.project(read + pos, torch.cat([self.W_Q, self.W_K]), self._biases("b_Q", "b_K"))
        return (*qk.chunk(2, dim=-3), forward.project(read, self.W_V, self.b_V))

    def queries(self, x: Tensor, pos: Tensor | None = None) -> Tensor:
        """``[..., t, d_model] -> [..., n_heads, t, d_head]``; ``pos``: shortformer positions of these ``t``."""
        return self.project(x, self.W_Q, self.b_Q, pos)

    def keys(self, x: Tensor, pos: Tensor | None = None) -> Tensor:
        """``[..., t, d_model] -> [..., n_heads, t, d_head]``; ``pos``: shortformer positions of these ``t``."""
        return self.project(x, self.W_K, self.b_K, pos)

    def values(self, x: Tensor) -> Tensor:
        """``[..., t, d_model] -> [..., n_heads, t, d_head]`` (positions never reach the values)."""
        return self.project(x, self.W_V, self.b_V)

    def _biases(self, *names: str) -> Tensor | None:
        return None if self.b_Q is None else torch.cat([getattr(self, name) for name in names])

    def linear_keys(self, change: Tensor) -> Tensor:
        """How every head's keys move when the stream moves by ``change [..., d_model]``: ``[..., n_heads·d_head]``
        (one GEMM; positions and ``b_K`` do not move). Only where the layer reads affinely."""
        if not self.reads_affinely:
            raise ValueError("a normalized layer's keys are not linear in the stream")
        return change @ self.W_K.permute(1, 0, 2).flatten(1)

    def linear_qkv(self, change: Tensor) -> Tensor:
        """How every head's queries, keys and values move when the stream moves by ``change [..., d_model]``:
        ``[..., 3·n_heads·d_head]`` (queries, keys, values; one GEMM). Only where the layer reads affinely."""
        if not self.reads_affinely:
            raise ValueError("a normalized layer's queries, keys and values are not linear in the stream")
        return change @ torch.cat([self.W_Q, self.W_K, self.W_V]).permute(1, 0, 2).flatten(1)

    def key_input_gradients(self, x: Tensor, key_gradients: Tensor, pos: Tensor | None = None) -> Tensor:
        """``∂L/∂x_key [b, n_heads, t, d_model]``: the gradient reaching each head's own copy of the
        stream ``x [b, t, d_model]`` it reads its keys from, given ``∂L/∂k [b, n_heads, t, d_head]``
        (a vector-Jacobian product through the norm and this head's key projection alone)."""
        with torch.inference_mode(False), torch.enable_grad():
            stream = x.detach().requires_grad_()
            per_head = stream[:, None].expand(-1, self.W_K.shape[0], -1, -1)  # (b, h, t, d): one input per head
            read = self.normalize(per_head) if pos is None else self.normalize(per_head) + pos
            keys = torch.einsum("bhtd,hde->bhte", read, self.W_K)
            if self.b_K is not None:
                keys = keys + self.b_K[:, None]
            (gradient,) = torch.autograd.grad(keys, per_head, key_gradients)
        return gradient

    def forward(self, x: Tensor, pos: Tensor | None = None, tokens: Tensor | None = None) -> Tensor:
        """The stream ``x [b, t, d]`` through this layer, ``[b, t, d]`` (:func:`models.forward.attention_layer`,
        as the model's pass runs it); ``pos [t, d]``: shortformer positions; ``tokens [b, t]``: a clamp's."""
        weights = dict(self.named_parameters())
        return forward.attention_layer(weights, "", x[None], self.normalization, pos, (self.changes,), tokens)[0]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``q, k, v [b, h, t, e]`` -> ``(pattern [b, h, t, t], z [b, h, t, e])`` with this layer's
        :attr:`changes` applied: the hook points of every head, shared by training and the metrics."""
        return attend(q, k, v, self.changes, tokens)

    def write(self, z: Tensor) -> Tensor:
        """Every head's output ``z [..., h, t, e]`` into the stream ``[..., t, d]`` (and ``b_O``)."""
        return forward.write(z, self.W_O, self.b_O)

    def rows(self, x: Tensor, rows: slice, pos: Tensor | None = None, qkv: tuple | None = None) -> Tensor:
        """The stream ``x [..., t, d]`` after this layer at the positions ``rows`` alone ``[..., s, d]``:
        the pattern rows and the output there only. ``qkv``: this layer's queries, keys and values of
        ``x``, if already known. Without the layer's interventions."""
        q, k, v = self.qkv(x, pos) if qkv is None else qkv
        z = causal_pattern(q[..., rows, :], k, first_query=rows.start) @ v
        return x[..., rows, :] + self.write(z)

    def pattern(self, x_query: Tensor, x_key: Tensor | None = None, pos: Tensor | None = None) -> Tensor:
        """Explicit causal attention pattern ``[batch, n_heads, query_pos, key_pos]``.

        ``x_key`` (default: ``x_query``) is the residual stream the keys read, so a caller can
        change the keys' input alone, e.g. for a K-only path ablation; ``pos``: shortformer positions.
        """
        x_key = x_query if x_key is None else x_key
        return causal_pattern(self.queries(x_query, pos), self.keys(x_key, pos))

    def head_outputs(self, x: Tensor, pattern: Tensor) -> Tensor:
        """Each head's write into the residual stream, ``[batch, n_heads, pos, d_model]`` (``b_O``,
        the layer's, belongs to no head)."""
        return (pattern @ self.values(x)) @ self.W_O[None]


class AttentionOnlyTransformer(nn.Module):
    """Token + learned positional embeddings, ``n_layers`` attention layers, (norm), unembedding.

    ``W_E [d_vocab, d_model]``, ``W_pos [n_ctx, d_model]``, ``W_U [d_model, d_vocab]`` (and ``b_U
    [d_vocab]`` with ``shape.biases``, else None). With ``shape.positions == "shortformer"`` the
    stream holds the tokens alone and ``W_pos`` reaches only the queries' and keys' inputs.
    """

    def __init__(
        self, shape: TransformerShape, init: InitScheme = "fan_in", init_std: float | None = None, device=None
    ) -> None:
        """``init`` (:data:`INITS`): ``normal`` draws every weight matrix from N(0, init_std²) (the
        old library default of 0.02 that aslvrstn 2022's script documents), ``gpt2`` from
        N(0, (0.8/sqrt(d_model))²), EasyTransformer's ``init_mode="gpt2"``; biases stay 0, gains 1.
        ``device``: where the weights are made (None: torch's default device)."""
        super().__init__()
        if problems := init_problems(init, init_std):
            raise ValueError("; ".join(problems))
        self.shape = shape
        d = shape.d_model
        self.W_E = nn.Parameter(torch.randn(shape.d_vocab, d, device=device) / math.sqrt(d))
        self.W_pos = nn.Parameter(torch.randn(shape.n_ctx, d, device=device) / math.sqrt(d))
        self.layers = nn.ModuleList(AttentionLayer(shape, device) for _ in range(shape.n_layers))
        self.final_norm = make_norm(shape.normalization, d, device)
        self.W_U = nn.Parameter(torch.randn(d, shape.d_vocab, device=device) / math.sqrt(d))
        biases = shape.biases
        self.register_parameter("b_U", nn.Parameter(torch.zeros(shape.d_vocab, device=device)) if biases else None)
        std = {"fan_in": None, "normal": init_std, "gpt2": 0.8 / math.sqrt(d)}[init]
        if std is not None:  # drawn after the fan-in weights, as before: a run's random stream does not move
            with torch.no_grad():
                for name, weight in self.named_parameters():
                    if name.rsplit(".", 1)[-1].startswith("W_"):
                        weight.normal_(0.0, std)

    @property
    def shortformer(self) -> bool:
        return self.shape.positions == "shortformer"

    def weights(self) -> dict[str, Tensor]:
        """Every weight by its parameter name, as :mod:`models.forward` reads them."""
        return dict(self.named_parameters())

    def embed(self, tokens: Tensor) -> Tensor:
        """``[batch, pos]`` token ids -> residual stream ``[batch, pos, d_model]`` (tokens and
        positions; tokens alone with shortformer positions, see :meth:`positions`)."""
        return forward.embed({"W_E": self.W_E, "W_pos": self.W_pos}, tokens, self.shape)

    def positions(self, n_positions: int) -> Tensor | None:
        """What the queries and keys add to their input, ``[pos, d_model]``: the positions with
        shortformer, else None (they are in the stream already)."""
        return self.W_pos[:n_positions] if self.shortformer else None

    def unembed(self, x: Tensor) -> Tensor:
        """Residual stream ``[..., pos, d_model]`` -> logits ``[..., pos, d_vocab]``."""
        weights = {"final_norm.weight": norm_gain(self.final_norm), "W_U": self.W_U, "b_U": self.b_U}
        return forward.unembed(weights, x, self.shape)

    @property
    def unembeds_affinely(self) -> bool:
        """Whether the logits are affine in the final stream (no final normalization)."""
        return isinstance(self.final_norm, nn.Identity)

    def linear_unembed(self, change: Tensor) -> Tensor:
        """How the logits move when the final stream moves by ``change [..., d_model]``: ``[..., d_vocab]``.
        Only where the model unembeds affinely."""
        if not self.unembeds_affinely:
            raise ValueError("a normalized stream's logits are not linear in it")
        return change @ self.W_U

    def run_layers(self, first: int, x: Tensor, rows: slice, first_qkv: tuple | None = None) -> Tensor:
        """The stream ``x [..., t, d_model]`` entering layer ``first`` through every layer from it on,
        the last one at the positions ``rows`` only: ``[..., s, d_model]`` (what the unembedding reads
        there). ``first_qkv``: layer ``first``'s queries, keys and values of ``x``, if already known.
        Explicit patterns, without the layers' interventions."""
        layers, pos = self.layers[first:], self.positions(x.shape[-2])
        for i, layer in enumerate(layers):
            qkv = first_qkv if i == 0 else None
            if i == len(layers) - 1:
                return layer.rows(x, rows, pos, qkv)
            q, k, v = layer.qkv(x, pos) if qkv is None else qkv
            x = x + layer.write(causal_pattern(q, k) @ v)
        return x[..., rows, :]

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[batch, pos, d_vocab]`` for ``tokens [batch, pos]`` (the training path,
        :func:`models.forward.logits`: fused attention, explicit patterns where heads are intervened on)."""
        changes = [(layer.changes,) for layer in self.layers] if self.intervened else None
        return forward.logits(self.weights(), tokens, self.shape, changes)[0]

    def set_changes(self, by_layer: dict[int, Sequence[HeadChange]]) -> None:
        """Make ``by_layer`` (layer index -> its heads' changes) the active interventions; {} for none."""
        for index, layer in enumerate(self.layers):
            layer.changes = tuple(by_layer.get(index, ()))

    @property
    def intervened(self) -> bool:
        """Whether any forward-pass intervention is active."""
        return any(layer.changes for layer in self.layers)

    @contextmanager
    def changes_off(self) -> Iterator[None]:
        """The model without its active interventions, inside the block (they come back after it)."""
        saved = [layer.changes for layer in self.layers]
        self.set_changes({})
        try:
            yield
        finally:
            for layer, changes in zip(self.layers, saved):
                layer.changes = changes

    def run_with_cache(self, tokens: Tensor, head_out: bool = True) -> tuple[Tensor, dict[str, list[Tensor]]]:
        """Logits plus what the metrics read, computed with explicit attention patterns.

        Returns ``(logits [b, t, d_vocab], cache)`` where ``cache["resid_pre"][l]`` is layer l's
        input ``[b, t, d_model]`` (the stream: without the positions under shortformer),
        ``cache["pattern"][l]`` its attention ``[b, h, t, t]`` (after the active interventions, the
        one that mixed the values: :meth:`AttentionLayer.attend`), ``cache["q"][l]``, ``cache["k"][l]``,
        ``cache["v"][l]`` its queries, keys and values ``[b, h, t, d_head]`` (before any intervention),
        ``cache["z"][l]`` each head's mixed values ``[b, h, t, d_head]`` (after an ablation, its
        replacement), ``cache["resid_final"]`` the stream after the last layer ``[b, t, d_model]`` and, with ``head_out``,
        ``cache["head_out"][l]`` each head's write ``[b, h, t, d_model]`` (without ``b_O``). The
        stream itself adds the heads' writes as one GEMM over ``(head, d_head)``: without
        ``head_out`` the pass costs about a forward pass, with it (``h`` times the write's memory)
        up to twice that.
        """
        cache: dict[str, list[Tensor]] = {
            "resid_pre": [],
            "pattern": [],
            "q": [],
            "k": [],
            "v": [],
            "z": [],
            **({"head_out": []} if head_out else {}),
        }
        x, pos = self.embed(tokens), self.positions(tokens.shape[-1])
        for layer in self.layers:
            q, k, v = layer.qkv(x, pos)  # (b, h, t, e) each
            pattern, z = layer.attend(q, k, v, tokens)  # (b, h, t, t), (b, h, t, e)
            for name, value in (("q", q), ("k", k), ("v", v)):
                cache[name].append(value)
            cache["resid_pre"].append(x)
            cache["pattern"].append(pattern)
            cache["z"].append(z)
            if head_out:
                cache["head_out"].append(einsum(z, layer.W_O, "b h t e, h e d -> b h t d"))
            x = x + layer.write(z)
        cache["resid_final"] = x
        return self.unembed(x), cache
