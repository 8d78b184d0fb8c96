"""Causal ground truth for K-composition (docs/measures.md, "Ground truth: ablation").

For writer h1 (layer l1) and reader h2 (layer l2 > l1), on the probe batch: replace h1's output in
the input of h2's *keys only* (queries, values and every other head untouched), then measure how
much h2's attention pattern moves and how much the repeated-token loss rises. What replaces it
(``kind``, :data:`ABLATION_KINDS`):

- ``per_position`` (default): its mean over the probe batch at each position, the usual mean
  ablation (it keeps what the position alone tells);
- ``pooled``: its mean over the batch and all positions;
- ``resample``: its output on another probe sequence (the next one, cyclically), a resample ablation.

The result equals running the model once per pair (``per_pair_loop`` in ``tests/metrics/test_ablation.py``),
but costs less, because most of that work is shared or low-rank:

- **Nothing below the reader's layer runs again.** The residual stream entering layer l2 is the
  clean one; only layer l2 and the layers after it are recomputed.
- **Key change.** h1 writes ``write = z @ W_O^{h1}`` with ``z [b, t, d_head]`` its pattern-weighted
  values. Without normalization the keys are linear in their input, so the ablated keys of
  every head of layer l2 are ``k + scale·(z' - z) @ (W_O^{h1} @ W_K^{l2})`` (``z'`` the replacement): a
  ``d_head x (n_heads·d_head)`` product per writer instead of a ``d_model``-wide projection. With
  LayerNorm/RMSNorm the norm is not linear and ``norm(x + scale·(write' - write)) @ W_K`` is computed
  as it stands.
- **Reader change.** Only h2's pattern moves, so after layer l2 the stream is the clean one plus
  ``Δz @ W_O^{h2}`` (``Δz = Δpattern @ v``, rank ``d_head``). Without normalization the next read
  (layer l2+1's queries, keys and values, or the unembedding when l2 is last) is linear too and
  is computed as ``clean read + Δz @ (W_O^{h2} @ W_read)``.
- **Bounded memory.** The work of a reader layer is cut into blocks of (writer, sequence) rows,
  each row carrying all ``n_heads`` readers, sized so that a block's intermediates stay under
  ``max_chunk_bytes``. Only the final ``[L, H, L, H]`` results leave the model's device and dtype.

``scale`` (default 1, the ablation) moves the key input by ``scale·(write' - write)`` instead,
so that ``effect / scale`` can be checked, for a small scale, against the first-order estimate of
:mod:`metrics.ground_truth.attribution`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from data.probe import ProbeBatch
from metrics.composition.engine import DEFAULT_CHUNK_BYTES
from models.attention import causal_pattern
from models.interventions import replacement_of
from models.transformer import AttentionOnlyTransformer, TransformerShape

DEFAULT_MAX_CHUNK_BYTES = DEFAULT_CHUNK_BYTES  # the same budget as the composition engine's chunks
AblationKind = Literal["per_position", "pooled", "resample"]
"""What replaces a writer's output: its batch mean at each position (the usual mean ablation), its
mean over batch and positions, or its output on another probe sequence
(:func:`models.interventions.replacement_of`, which the training-time ablations use too)."""
ABLATION_KINDS: tuple[AblationKind, ...] = get_args(AblationKind)


@dataclass(frozen=True)
class KeyAblation:
    """Per pair ``[n_layers, n_heads, n_layers, n_heads]``, NaN unless the reader's layer is later.

    ``pattern_change``: mean total-variation distance ``½ Σ_j |a_ij - a'_ij|`` of h2's attention
    rows, in [0, 1]. ``loss_change``: repeated-token loss after minus before (nats; > 0 hurts).
    """

    pattern_change: Tensor
    loss_change: Tensor

    def effects(self) -> dict[str, Tensor]:
        """Both effects by name: ``{"loss_change": ..., "pattern_change": ...}``."""
        return {"loss_change": self.loss_change, "pattern_change": self.pattern_change}


@torch.inference_mode()
def key_ablation_effects(
    model: AttentionOnlyTransformer,
    probe: ProbeBatch,
    clean_run: tuple[Tensor, dict] | None = None,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    scale: float = 1.0,
    kind: AblationKind = "per_position",
) -> KeyAblation:
    """The K-only ablation effect of every earlier->later head pair on ``probe``.

    h1's write is replaced (``kind``: :func:`replacement_of`) in the residual stream that h2's keys
    read; h2's queries and values, and every other head, see the clean stream.

    ``clean_run``: ``model.run_with_cache(probe.tokens)`` in eval mode, if the caller has it already.
    ``max_chunk_bytes``: rough bound on the intermediates alive at once (the clean run's tensors,
    ``O(n_layers · batch · pos · d_model)``, come on top; the smallest block is one writer on one
    sequence). ``scale``: move the key input by ``scale · (replacement - write)`` (1: the ablation).
    """
    pattern_change, loss_change = _ablate(model, probe, clean_run, max_chunk_bytes, scale, kind, with_loss=True)
    return KeyAblation(pattern_change, loss_change)


@torch.inference_mode()
def key_pattern_changes(
    model: AttentionOnlyTransformer,
    probe: ProbeBatch,
    clean_run: tuple[Tensor, dict] | None = None,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    scale: float = 1.0,
    kind: AblationKind = "per_position",
) -> Tensor:
    """``pattern_change`` of :func:`key_ablation_effects` alone, ``[L, H, L, H]`` float64 on CPU:
    it needs only the reader's layer, so no layer after it is run."""
    pattern_change, _ = _ablate(model, probe, clean_run, max_chunk_bytes, scale, kind, with_loss=False)
    return pattern_change


def ablation_cost(shape: TransformerShape, probe_batch: int, probe_len: int, n_scored: int | None = None) -> float:
    """Matmul FLOPs (2 per multiply-add) of :func:`key_ablation_effects`, given the clean run.

    ``b = probe_batch`` sequences of ``t = probe_len`` tokens; ``s = n_scored`` scored positions (the
    repeated tokens ``t_2 .. t_n``; None: ``probe_len // 2 - 1``, a probe without a gap); ``L, H, d, e, V`` the model's layers, heads,
    ``d_model``, ``d_head``, vocabulary; ``He = H·e``; ``W = l2·H`` writers before reader layer l2.
    Softmaxes, norms and other elementwise work are left out (lower order). Term by term:

    - nothing for the clean run: its queries, keys and values and the writers' ``z = pattern @ v``
      come with it (``run_with_cache``);
    - per reader layer l2 = 1 .. L-1:
      - clean pattern ``b·H·t²·e``; ablated patterns ``W·b·H·t²·e``; ``Δz = Δpattern @ v``: the same;
      - ablated keys: ``W·e·d·He`` (``W_O^{h1} @ W_K``) + ``W·b·t·e·He`` without normalization,
        ``W·b·t·d·He`` with it;
      - ``R = W·H·b`` ablated sequences after the reader layer, plus ``b`` clean ones (which reuse
        the clean run's q, k, v or logits, so skip the first read):
        - the stream ``x + Δz @ W_O^{h2}``: ``R·t·e·d`` (not needed without normalization when l2
          is last);
        - the first read: the unembedding ``V`` wide at ``s`` positions, else the next layer's
          q, k, v ``3He`` wide at ``t`` positions: ``H·e·d·width + R·positions·e·width`` without normalization
          (through ``W_O^{h2} @ W_read``), ``R·positions·d·width`` with it;
        - then ``R + b`` times: the rest of the next layer (attention ``2·H·t²·e``, output
          ``t·He·d``); every full layer after it ``t·d·3He + 2·H·t²·e + t·He·d``; the last layer,
          which is only read at the scored positions, ``t·d·3He + 2·H·s·t·e + s·He·d``
          (when the next layer is the last, its attention and output are at ``s`` rows too);
          the unembedding ``s·d·V``.

    All times 2. The ablated sequences dominate: ``O(Σ_l2 l2·H²·b·(L-1-l2)·t·d·He)``, cubic in
    depth, which is why large models use :mod:`metrics.ground_truth.attribution` instead.
    """
    L, H, d, e, V = shape.n_layers, shape.n_heads, shape.d_model, shape.d_head, shape.d_vocab
    b, t, He = probe_batch, probe_len, shape.n_heads * shape.d_head
    s = probe_len // 2 - 1 if n_scored is None else n_scored
    linear = shape.normalization == "none"

    def attention_and_output(rows: int) -> int:  # per sequence, ``rows`` query positions
        return 2 * H * rows * t * e + rows * He * d

    full_layer = t * d * 3 * He + attention_and_output(t)
    last_layer = t * d * 3 * He + attention_and_output(s)
    macs = 0  # the clean run's q, k, v and z come with it
    for l2 in range(1, L):
        W, R, after = l2 * H, l2 * H * H * b, L - 1 - l2
        macs += (1 + 2 * W) * b * H * t * t * e
        macs += (W * e * d * He + W * b * t * e * He) if linear else W * b * t * d * He
        if not (linear and after == 0):
            macs += R * t * e * d
        if after == 0:
            macs += (H * e * d * V + R * s * e * V) if linear else R * s * d * V
            continue
        if linear:
            macs += H * e * d * 3 * He + R * t * e * 3 * He
        else:
            macs += R * t * d * 3 * He
        rest = (
            attention_and_output(s) if after == 1 else attention_and_output(t) + (after - 2) * full_layer + last_layer
        )
        macs += (R + b) * (rest + s * d * V)
    return 2.0 * macs


# --- the clean run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CleanRun:
    """What the ablation reads from the clean forward pass, on the model's device.

    ``stream[l]``: layer l's input ``[b, t, d]``, ``stream[L]`` the final stream; ``logits``
    ``[b, t, V]``; ``q, k, v[l]`` ``[b, H, t, e]`` for the reader layers l >= 1 (None for layer 0);
    ``z[l] = pattern @ v`` ``[b, H, t, e]`` for the writer layers l < L-1 (None with normalization,
    which reads the writes themselves); ``writes[l]``: each head's write ``[b, H, t, d]``.
    """

    stream: list[Tensor]
    logits: Tensor
    q: list[Tensor | None]
    k: list[Tensor | None]
    v: list[Tensor | None]
    z: list[Tensor] | None
    writes: list[Tensor]

    @classmethod
    def of(cls, model: AttentionOnlyTransformer, clean_run: tuple[Tensor, dict]) -> _CleanRun:
        """From ``model.run_with_cache`` (its streams, queries, keys, values, mixed values and writes)."""
        logits, cache = clean_run
        q, k, v = ([None, *cache[name][1:]] for name in "qkv")
        # the writers' pattern-weighted values (after a training-time ablation: its replacement), for
        # their d_head-wide key change where the keys are linear in the stream
        z = list(cache["z"][:-1]) if _is_linear(model) else None
        return cls([*cache["resid_pre"], cache["resid_final"]], logits, q, k, v, z, list(cache["head_out"]))


def _is_linear(model: AttentionOnlyTransformer) -> bool:
    """True when nothing sits between the residual stream and a head's (or the unembedding's) read."""
    return model.unembeds_affinely and all(layer.reads_affinely for layer in model.layers)


# --- driver --------------------------------------------------------------------------------------


def _ablate(
    model, probe: ProbeBatch, clean_run, max_chunk_bytes: int, scale: float, kind: AblationKind, with_loss: bool
) -> tuple[Tensor, Tensor | None]:
    """Both effects (the loss only ``with_loss``) as ``[L, H, L, H]`` float64 CPU tensors."""
    was_training = model.training
    model.eval()
    try:
        tokens = probe.tokens.to(model.W_E.device)
        clean = _CleanRun.of(model, model.run_with_cache(tokens) if clean_run is None else clean_run)
        L, H = model.shape.n_layers, model.shape.n_heads
        pattern_change = torch.full((L * H, L * H), float("nan"), dtype=torch.float64, device="cpu")
        loss_change = pattern_change.clone()
        for l2 in range(1, L):
            patterns, losses = _reader_layer_effects(
                model, clean, tokens, probe, l2, scale, kind, max_chunk_bytes, with_loss
            )
            pattern_change[: l2 * H, l2 * H : (l2 + 1) * H] = patterns.cpu().double()
            if with_loss:
                loss_change[: l2 * H, l2 * H : (l2 + 1) * H] = losses.cpu().double()
    finally:
        model.train(was_training)
    return pattern_change.reshape(L, H, L, H), loss_change.reshape(L, H, L, H) if with_loss else None


def _reader_layer_effects(
    model,
    clean: _CleanRun,
    tokens: Tensor,
    probe: ProbeBatch,
    l2: int,
    scale: float,
    kind: AblationKind,
    max_chunk_bytes: int,
    with_loss: bool,
) -> tuple[Tensor, Tensor | None]:
    """Both effects of ablating each writer (the ``W = l2 · H`` heads of layers < l2, flat order
    ``l1 · H + h1``) from the keys of each head of layer ``l2``: ``([W, H], [W, H] or None)``.

    Sums over sequences and positions accumulate block by block, and are averaged at the end.
    """
    H, (b, t, _) = model.shape.n_heads, clean.stream[l2].shape
    n_scored = probe.n - 1
    accumulate = torch.promote_types(clean.q[l2].dtype, torch.float32)
    keys = _AblatedKeys(model, clean, l2, scale, kind)
    after = _LayersAfter(model, clean, l2, tokens, probe) if with_loss else None
    q, v = clean.q[l2], clean.v[l2]
    clean_pattern = causal_pattern(q, clean.k[l2])  # (b, H, t, t)
    tv_sums = torch.zeros(keys.n_writers, H, dtype=accumulate, device=q.device)
    loss_sums = torch.zeros_like(tv_sums)
    layers_after = model.shape.n_layers - 1 - l2 if with_loss else None
    rows = max(1, max_chunk_bytes // _bytes_per_row(model.shape, t, n_scored, q.element_size(), layers_after))
    for writers, sequences in _blocks(keys.n_writers, b, rows):
        ablated_keys, moved = keys.block(writers, sequences)  # (w, s, H, t, e), (w, s, H)
        delta_pattern = causal_pattern(q[sequences], ablated_keys).sub_(clean_pattern[sequences])  # (w, s, H, t, t)
        delta_pattern.mul_(moved[..., None, None])  # where the keys did not move: exactly 0, not rounding noise
        if with_loss:
            loss_sums[writers] += after.loss_change_sums(delta_pattern @ v[sequences], sequences)
        tv_sums[writers] += 0.5 * delta_pattern.abs_().sum(dim=(1, 3, 4), dtype=accumulate)
    return tv_sums / (b * t), loss_sums / (b * n_scored) if with_loss else None


def _blocks(n_writers: int, n_sequences: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """Cover the (writer, sequence) grid with blocks of at most ``rows`` rows (at least one row):
    several writers on every sequence while one writer's sequences fit, else slices of one writer's
    sequences."""
    if rows >= n_sequences:
        per_block = rows // n_sequences
        for w in range(0, n_writers, per_block):
            yield slice(w, min(w + per_block, n_writers)), slice(0, n_sequences)
    else:
        for w in range(n_writers):
            for s in range(0, n_sequences, rows):
                yield slice(w, w + 1), slice(s, min(s + rows, n_sequences))


def _bytes_per_row(shape: TransformerShape, t: int, n_scored: int, itemsize: int, layers_after: int | None) -> int:
    """Rough peak bytes of one (writer, sequence) row, with all H readers.

    Reader layer: the key shift, ablated keys and Δz (``H·t·e`` each; with normalization the key
    input ``t·d`` twice instead of the shift), scores, pattern, Δpattern and its absolute value
    (``H·t²`` each). Then, unless ``layers_after`` is None (no loss wanted), each of the H ablated
    sequences: logits and their log-softmax (``s·V`` each, at least float32); the stream and its
    norm (``t·d``) where the unembedding reads it; with layers after the reader, the stream, a
    layer's output and the next stream (``t·d``), the next read and its sum (``t·3He``),
    scores, masked scores and pattern (``H·t²``), z and its merged copy (``H·t·e``).
    """
    H, d, e, V = shape.n_heads, shape.d_model, shape.d_head, shape.d_vocab
    linear = shape.normalization == "none"
    reader = 3 * H * t * e + 4 * H * t * t + (t * e if linear else 2 * t * d)
    if layers_after is None:
        return itemsize * reader
    logits = 2 * n_scored * V * max(1, 4 // itemsize)
    if layers_after == 0:
        downstream = logits + (0 if linear else 2 * t * d)
    else:
        downstream = logits + 3 * t * d + 2 * t * 3 * H * e + 3 * H * t * t + 2 * H * t * e
    return itemsize * (reader + H * downstream)


def _writer_rows(per_layer: list[Tensor], writers: slice, sequences: slice, n_heads: int) -> Tensor:
    """``[w, s, t, ·]``: the writers' rows of per-layer ``[b, H, t, ·]`` tensors (flat writer order)."""
    return torch.stack([per_layer[w // n_heads][sequences, w % n_heads] for w in range(writers.start, writers.stop)])


def _writer_replacements(per_layer: list[Tensor], kind: AblationKind) -> Tensor:
    """``[W, b or 1, t or 1, ·]``: each writer's replacement (:func:`replacement_of`) from per-layer
    ``[b, H, t, ·]`` tensors, in flat writer order."""
    return torch.cat([replacement_of(x, kind).transpose(0, 1) for x in per_layer])


# --- the reader layer ----------------------------------------------------------------------------


class _AblatedKeys:
    """The keys of reader layer l2's heads with one writer's write moved ``scale`` of the way to its replacement."""

    def __init__(self, model, clean: _CleanRun, l2: int, scale: float, kind: AblationKind) -> None:
        self.layer, self.clean, self.l2, self.scale = model.layers[l2], clean, l2, scale
        self.pos = model.positions(clean.stream[0].shape[1])
        self.n_heads = model.shape.n_heads
        self.n_writers = l2 * self.n_heads
        self.linear = clean.z is not None
        if self.linear:
            W_O = torch.cat([layer.W_O for layer in model.layers[:l2]])  # (W, e, d)
            self.write_to_keys = self.layer.linear_keys(W_O)  # (W, e, H·e): W_O^{h1} W_K for every reader at once
            self.reaches_keys = (
                self.write_to_keys.unflatten(-1, (self.n_heads, -1)).ne(0).any(dim=-1).any(dim=1)
            )  # (W, H)
            self.replacement = _writer_replacements(clean.z[:l2], kind)  # (W, b or 1, t or 1, e)
        else:
            self.replacement = _writer_replacements(clean.writes[:l2], kind)  # (W, b or 1, t or 1, d)

    def _replacement_rows(self, writers: slice, sequences: slice) -> Tensor:
        rows = self.replacement[writers]
        return rows if rows.shape[1] == 1 else rows[:, sequences]

    def block(self, writers: slice, sequences: slice) -> tuple[Tensor, Tensor]:
        """Ablated keys ``[w, s, H, t, e]`` for a block, and which (writer, sequence, reader) moved ``[w, s, H]``."""
        if self.linear:
            return self._linear(writers, sequences)
        return self._normalized(writers, sequences)

    def _linear(self, writers: slice, sequences: slice) -> tuple[Tensor, Tensor]:
        z = _writer_rows(self.clean.z, writers, sequences, self.n_heads)  # (w, s, t, e)
        w, s, t, e = z.shape
        shift = self.scale * (self._replacement_rows(writers, sequences) - z)
        delta = (shift.flatten(1, 2) @ self.write_to_keys[writers]).view(w, s, t, self.n_heads, e).transpose(2, 3)
        moved = shift.ne(0).flatten(-2).any(dim=-1)[..., None] & self.reaches_keys[writers, None]
        keys = torch.empty(
            w, s, self.n_heads, t, e, dtype=delta.dtype, device=delta.device
        )  # contiguous: q kᵀ needs no copy
        return torch.add(self.clean.k[self.l2][sequences], delta, out=keys), moved

    def _normalized(self, writers: slice, sequences: slice) -> tuple[Tensor, Tensor]:
        writes = _writer_rows(self.clean.writes, writers, sequences, self.n_heads)  # (w, s, t, d)
        w, s, t, d = writes.shape
        shift = self.scale * (self._replacement_rows(writers, sequences) - writes)
        x_key = self.clean.stream[self.l2][sequences] + shift
        keys = self.layer.keys(x_key, self.pos)  # (w, s, H, t, e)
        moved = shift.ne(0).flatten(-2).any(dim=-1)[..., None].expand(w, s, self.n_heads)
        return keys, moved


# --- the layers after the reader -----------------------------------------------------------------


class _LayersAfter:
    """Runs the layers after reader layer l2 for many ablated (writer, reader, sequence) rows and
    scores the repeated tokens, against the clean run along the very same path."""

    def __init__(self, model, clean: _CleanRun, l2: int, tokens: Tensor, probe: ProbeBatch) -> None:
        self.model, self.l2 = model, l2
        self.last = l2 == model.shape.n_layers - 1
        self.linear = _is_linear(model)
        self.W_O = model.layers[l2].W_O  # (H, e, d): the reader heads' writes
        self.stream = clean.stream[l2 + 1]  # (b, t, d): the clean stream after layer l2
        self.scored = probe.repeated  # predicting t_2 .. t_n
        self.targets = tokens[:, self.scored.start + 1 : self.scored.stop + 1]  # (b, s)
        if self.last:  # the next read is the unembedding, at the scored positions only
            self.clean_read = clean.logits[:, self.scored]  # (b, s, V)
            read = model.linear_unembed if self.linear else None
        else:  # the next read is layer l2 + 1's queries, keys and values
            self.clean_read = torch.cat([clean.q[l2 + 1], clean.k[l2 + 1], clean.v[l2 + 1]], dim=1)  # (b, 3H, t, e)
            read = model.layers[l2 + 1].linear_qkv if self.linear else None
        self.write_to_read = None if read is None else read(self.W_O)  # (H, e, V or 3H·e): W_O^{h2} W_read
        self.clean_losses = self._loss_sums(self.stream, self.clean_read, self.targets)  # (b,)

    def loss_change_sums(self, delta_z: Tensor, sequences: slice) -> Tensor:
        """Summed over the block's sequences and scored positions: the loss change of each
        (writer, reader) whose reader output moved by ``delta_z [w, s, H, t, e]`` -> ``[w, H]``."""
        delta_z = delta_z.transpose(1, 2)  # (w, H, s, t, e)
        w, H, s, t, e = delta_z.shape
        stream = None
        if not (self.linear and self.last):  # the stream itself is needed downstream
            stream = self.stream[sequences] + torch.einsum("whste,hed->whstd", delta_z, self.W_O)
        if self.linear:  # read the change through W_O^{h2} W_read: d_head wide, not d_model
            if self.last:
                read = self.clean_read[sequences] + torch.einsum(
                    "whste,hev->whstv", delta_z[..., self.scored, :], self.write_to_read
                )
            else:
                delta_read = torch.einsum("whste,hek->whstk", delta_z, self.write_to_read).unflatten(-1, (3 * H, e))
                read = self.clean_read[sequences] + delta_read.transpose(-3, -2)  # (w, H, s, 3H, t, e)
            read = read.flatten(0, 2)
        else:
            read = None
        losses = self._loss_sums(
            None if stream is None else stream.flatten(0, 2), read, self.targets[sequences].repeat(w * H, 1)
        )
        delta = losses.view(w, H, s) - self.clean_losses[sequences]
        moved = delta_z.ne(0).flatten(-2).any(dim=-1)  # (w, H, s): an unmoved row changes nothing
        return torch.where(moved, delta, 0).sum(dim=-1)

    def _loss_sums(self, stream: Tensor | None, read: Tensor | None, targets: Tensor) -> Tensor:
        """Repeated-token loss summed over the scored positions of each row ``[n]``, from the
        stream after layer l2 ``[n, t, d]`` and/or its first read (``[n, s, V]`` logits when l2 is
        last, else ``[n, 3H, t, e]`` queries, keys and values; None: compute it from the stream)."""
        if self.last:
            logits = read if read is not None else self.model.unembed(stream[:, self.scored])
        else:
            first_qkv = None if read is None else read.chunk(3, dim=1)
            logits = self.model.unembed(self.model.run_layers(self.l2 + 1, stream, self.scored, first_qkv))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32, e.g. for a bf16 model
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return losses.view(len(targets), -1).sum(dim=1)
