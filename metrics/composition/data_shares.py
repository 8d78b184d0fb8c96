"""Data-aware composition: each upstream part's share of what a reader head reads, on the probe batch.

The weight-based measures (:mod:`metrics.composition.measures`) ask how much of what a writer *could*
write a reader *could* read. aslvrstn 2022 ("Composition Measures in Transformers") wanted a score
that stays near zero until the induction head forms and then rises to its final value; that needs
to know which directions the residual stream actually carries. Here the question is asked of the
probe pass itself.

**The parts.** The stream a layer reads, ``x = resid_pre[l2] [b, t, d_model]``, is a sum of parts:
the tokens ``W_E[tok]``, the positions ``W_pos`` (in the stream unless shortformer), every earlier
head's write (``head_out``, without ``b_O``) and every earlier layer's ``b_O``. The reader's
normalization, its scale ``1/σ(x)`` frozen at the value of the probe pass (the usual linearisation, as
TransformerLens's residual-stream decomposition and direct logit attribution do), is linear in ``x``:
``norm(x) W = Σ_c x^c W̃ / σ`` with ``W̃ = C diag(g) W`` (:func:`~metrics.composition.circuits.fold_norm`),
so each query, key and value splits exactly into the parts' contributions. Shortformer positions
enter the queries and keys after the norm (a part of their own, unscaled); a reader's own ``b_Q``
is a part of its queries ("biases", with the ``b_O``).

**K share** of part c in reader head h2: the attention scores split as ``s_ij = Σ_c s^c_ij`` with
``s^c_ij = q_i · k^c_j / √e`` (the queries fixed). Softmax ignores a constant added to a query's row,
so each row is centred over its causal keys, ``s̃_ij = s_ij − mean_{j'≤i} s_ij'``; with ``centre``
``sequences`` (the default) the scores are then also centred over the probe's sequences at each
``(i, j)``, which takes out the pattern every sequence gets alike whatever its tokens (a
position-driven one), so that what is shared is the content-dependent part of the attention. The
share is ``Cov(s̃^c, s̃) / Var(s̃) = Σ s̃^c_ij s̃_ij / Σ s̃²_ij`` over the causal pairs of the weighed
rows (``rows``) of every probe sequence, or (``induction``) over each second-copy query's pair with
its induction target only, the key after its token's first occurrence: the part's share of the
match's advantage over the row. **Q share**: the queries split, the keys fixed. **V share**:
the reader's direct contribution to the logits, ``ℓ_i = Σ_j A_ij v_j W_O W̃_U`` (``W̃_U`` the
unembedding with the final norm folded in, frozen like the others), with its values split, over
the weighed positions (centred over the sequences at each position, or over all):
``Σ_i ⟨ℓ^c_i − ℓ̄^c, ℓ_i − ℓ̄⟩ / Σ_i |ℓ_i − ℓ̄|²``; the logits' metric, unlike the stream's, is one no
reparametrisation of the stream or of the head moves. For every reader and kind the parts' shares
sum to 1 (``b_K`` shifts a row by a constant and ``b_V`` writes a constant: both are 0 exactly). A
part that writes nothing has share 0; a residual rotation or (without a norm) any invertible map
of the stream, a change of the reader's QK or VO basis, and under LayerNorm a constant added to a
writer's rows change no share (bench.axiom_table). A share is a covariance ratio: it can be
negative (the part works against the rest) or above 1.

**The floor** (``floor``, ``tracker.share.floor``; 0 by default). A share is scale-free: on the
plateau, where a reader's content-dependent scores vary by a few hundredths of a logit, it shares
that out as fully as a formed circuit's tens of logits². Softmax has a scale of its own: a score
moved by one logit moves its weight e-fold. With ``floor = φ`` logit² a pair, the Q and K shares
are ``Σ s̃^c s̃ / (Σ s̃² + φ N)`` (``N`` the weighed pairs): the parts share ``V / (V + φ)`` of the
reader's content attention, ``V`` its mean variance a pair, and the rest ``φ / (V + φ)`` is the
floor's, as if one more part, of variance φ a pair and uncorrelated with the others, stood in the
scores. Every invariance above holds (the scores do not change); the parts no longer sum to 1.

**How.** Both centrings are orthogonal projections and each row of ``s̃`` sums to zero, so
``Σ_ij s̃^c_ij s̃_ij = Σ_j x^c_j · R_j`` with ``R_j = W̃_K g_j / σ_j`` and ``g_j = Σ_i s̃_ij q_i / √e``:
one direction field ``R [b, h, t, d_model]`` per reader head and kind, and each part's numerator is
one product with it (likewise ``h_i = Σ_j s̃_ij k_j`` for Q, and ``u_j = Σ_i A_ij (ℓ_i − ℓ̄)`` for
V). The parts alike in every sequence (positions, ``b_O``) meet the fields' sums; the others (the
tokens, every head's write ``z W_O``) are formed a few positions at a time, in one sweep that
meets each block with every reader layer's fields there, two GEMMs a layer (:func:`part_products`):
no buffer of every part over the whole probe. Per reader layer ``O(b t d_model e H + b t d_model (L H) H)``,
no per-part scores; the queries' fields are zero on the rows that do not weigh and are skipped
there. Written here because TransformerLens's ``decompose_resid`` and ``stack_head_results`` give
the parts but no share of a reader's scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from data.probe import ProbeBatch
from metrics.composition.circuits import fold_norm
from metrics.composition.measures import COMPOSITION_KINDS
from models.transformer import AttentionOnlyTransformer

SHARE = "share"
"""The data-aware measure's name, beside the weight-based ones (``tracker.measures``;
registered by :mod:`metrics.tracked.composition`)."""
ROWS = ("all", "repeated", "induction")
"""Which of the probe's positions weigh: every one, the queries (for V: the writes) in the
repeated half, where induction is what the probe asks for, or (Q, K) only each of those queries'
induction pair, with the key after its token's first occurrence (V: the repeated half's writes)."""
DEFAULT_ROWS = "repeated"
"""The rows the tracker weighs unless told (``tracker.share.rows``)."""
CENTRES = ("sequences", "none")
"""What else is taken out of the scores (and writes) besides each query's mean: ``sequences``, their
mean over the probe's sequences at each (query, key) position (for V: at each position), the part
every sequence gets alike, whatever its tokens (a position-driven pattern); ``none``, nothing."""
DEFAULT_CENTRE = "sequences"
"""The centring the tracker uses unless told (``tracker.share.centre``)."""


@dataclass(frozen=True)
class DataShares:
    """The shares of one probe pass, per kind (``Q``, ``K``, ``V``).

    ``heads [L, H, L, H]``: writer head -> reader head (NaN where the reader's layer is not later);
    ``tokens``, ``positions``, ``biases`` ``[L, H]``: those parts' shares per reader head. For each
    reader and kind, the writer heads', tokens', positions' and biases' shares sum to 1."""

    heads: dict[str, Tensor]
    tokens: dict[str, Tensor]
    positions: dict[str, Tensor]
    biases: dict[str, Tensor]

    def to(self, device) -> DataShares:
        move = lambda by_kind: {kind: t.to(device) for kind, t in by_kind.items()}
        return DataShares(move(self.heads), move(self.tokens), move(self.positions), move(self.biases))

    def total(self, kind: str) -> Tensor:
        """``[L, H]``: every part's share summed, per reader (1 up to rounding)."""
        return self.heads[kind].nansum((0, 1)) + self.tokens[kind] + self.positions[kind] + self.biases[kind]


def norm_scale(norm: torch.nn.Module, x: Tensor) -> Tensor:
    """``1 / σ(x)`` ``[..., 1]``: what the normalization divides its (centred, gained) input by, at ``x``."""
    if isinstance(norm, torch.nn.LayerNorm):
        return torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
    if isinstance(norm, torch.nn.RMSNorm):
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return torch.ones_like(x[..., :1])


def row_weights(probe: ProbeBatch, rows: str, device) -> Tensor:
    """``[t]`` float: 1 for the probe's positions that weigh (``ROWS``), else 0."""
    weights = torch.ones(probe.tokens.shape[-1], device=device)
    if rows in ("repeated", "induction"):
        weights.zero_()
        weights[probe.repeat_start : probe.repeat_start + probe.n] = 1.0
    elif rows != "all":
        raise ValueError(f"rows must be one of {ROWS}, got {rows!r}")
    return weights


def induction_keys(probe: ProbeBatch, device) -> Tensor:
    """``[t, t]`` float: 1 at each second-copy query's induction pair ``(i, i − period + 1)``, the key
    after the first occurrence of query i's token, else 0 (``rows="induction"``)."""
    t = probe.tokens.shape[-1]
    keys = torch.zeros(t, t, device=device)
    queries = torch.arange(probe.repeat_start, min(probe.repeat_start + probe.n, t), device=device)
    keys[queries, queries - probe.period + 1] = 1.0
    return keys


@torch.no_grad()
def data_shares(
    model: AttentionOnlyTransformer,
    tokens: Tensor,
    cache: dict[str, list[Tensor]],
    weights: Tensor,
    centre: str = DEFAULT_CENTRE,
    keys: Tensor | None = None,
    floor: float = 0.0,
) -> DataShares:
    """The shares of every part in every reader head's queries, keys and values on ``tokens [b, t]``,
    from ``cache`` (``model.run_with_cache(tokens)``: its streams, patterns, queries, keys, values and
    mixed values ``z``; the heads' writes are formed here, ``z W_O``); ``weights [t]``
    (:func:`row_weights`), or ``[b, t]`` where the sequences differ, say which rows (Q, K) or writes
    (V) weigh; ``keys [t, t]`` (:func:`induction_keys`), if given, which of a weighed row's
    keys weigh (Q, K; None: every causal key); ``centre`` (:data:`CENTRES`) what else the scores are
    centred over; ``floor`` (logit², ≥ 0) is added to the Q and K shares' denominators for every
    weighed pair, so the parts share ``Var(s̃) / (Var(s̃) + floor)`` rather than 1 (0: the exact
    share). Readers in layer 0 have no earlier head and are not scored (NaN). On the model's device,
    in the cache's dtype."""
    if centre not in CENTRES:
        raise ValueError(f"centre must be one of {CENTRES}, got {centre!r}")
    L, H = model.shape.n_layers, model.shape.n_heads
    dtype, device = cache["resid_pre"][0].dtype, tokens.device
    b, t = tokens.shape
    nan = lambda *shape: torch.full(shape, math.nan, dtype=dtype, device=device)
    heads = {kind: nan(L, H, L, H) for kind in COMPOSITION_KINDS}
    tokens_share, positions_share, biases_share = ({kind: nan(L, H) for kind in COMPOSITION_KINDS} for _ in range(3))
    in_stream = not model.shortformer
    added = model.positions(t)  # (t, d) shortformer positions: into queries and keys, after the norm
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    w = weights.to(dtype).expand(b, t)[:, None, :, None]  # (b, 1, t, 1): over (sequence, head, row, ·)
    pairs = None if keys is None else keys.to(dtype) * causal  # (t, t): the weighed keys of a row
    weighed_pairs = (w * (causal.to(dtype) if pairs is None else pairs)).sum()  # the floor's count
    with_b_O = L > 1 and model.layers[0].b_O is not None
    b_O = torch.stack([layer.b_O for layer in model.layers[:-1]]).to(dtype) if with_b_O else None
    unembedding = fold_norm(model.final_norm, model.W_U, dtype)  # (d, vocab): C diag(g) W_U
    readers = []
    for l2 in range(1, L):
        layer = model.layers[l2]
        x = cache["resid_pre"][l2].to(dtype)
        qkv = (cache[n][l2] for n in "qkv") if "q" in cache else layer.qkv(x, added)  # the forward pass's
        q, k, v = (part.to(dtype) for part in qkv)  # (b, h, t, e)
        to_logits = layer.W_O.to(dtype) @ unembedding  # (h, e, vocab): the head's direct path to the logits
        fields, denominators = direction_fields(
            q, k, v, cache["pattern"][l2].to(dtype), to_logits, w, causal, centre == "sequences", pairs
        )
        denominators[:2] += floor * weighed_pairs  # Q and K: the scores' variance against the floor
        reads = (fold_norm(layer.norm, W, dtype).mT for W in (layer.W_Q, layer.W_K, layer.W_V))
        across = torch.stack(list(reads)).flatten(0, 1)  # (3 h, e, d): W̃ᵀ per (kind, reader)
        by_reader = fields.new_empty(3, H, t, b, fields.shape[-1])  # position-major, like the parts
        scale = norm_scale(layer.norm, x).transpose(0, 1)  # (t, b, 1): the norm's frozen 1/σ
        torch.mul(fields.permute(0, 2, 3, 1, 4), scale, out=by_reader)
        by_reader = by_reader.flatten(0, 1)  # (3 h, t, b, e)
        readers.append(ReaderFields(fields, denominators, by_reader, across))
    products = part_products(model, tokens, cache, readers, queries_read=(weights != 0).expand(b, t).any(0))
    for l2, reader, numerators in zip(range(1, L), readers, products):
        layer, denominators = model.layers[l2], reader.denominators
        numerators = numerators.view(3, H, -1) / denominators[:, :, None]
        # the parts alike in every sequence (positions) or everywhere (b_O) meet the fields' sums
        summed = reader.by_reader.sum(2)  # (3 h, t, e): Σ_b F
        biases = torch.zeros(3, H, dtype=dtype, device=device)
        if b_O is not None:
            read = (b_O[:l2] @ reader.across.mT).sum(1)  # (3 h, e): every earlier b_O, read by each reader
            biases += (read * summed.sum(1)).sum(-1).view(3, H) / denominators
        if layer.b_Q is not None:  # the reader's own b_Q is a part of its queries (b_K, b_V: 0 exactly)
            biases[0] += torch.einsum("he,bhte->h", layer.b_Q.to(dtype), reader.fields[0]) / denominators[0]
        positions = torch.zeros_like(biases)
        if in_stream:
            read = model.W_pos[:t].to(dtype) @ reader.across.mT  # (3 h, t, e): the positions, read by each reader
            positions += (read * summed).sum((1, 2)).view(3, H) / denominators
        if added is not None:  # shortformer: W_pos W into the queries and keys, after the norm, unscaled
            raw = torch.stack([layer.W_Q, layer.W_K]).to(dtype)
            fields = reader.fields[:2]
            positions[:2] = torch.einsum("td,khde,kbhte->kh", added.to(dtype), raw, fields) / denominators[:2]
        by_writer = numerators[:, :, 1:].view(3, H, l2, H)
        for i, kind in enumerate(COMPOSITION_KINDS):
            heads[kind][:l2, :, l2, :] = by_writer[i].permute(1, 2, 0)  # (writer layer, writer, reader)
            tokens_share[kind][l2] = numerators[i, :, 0]
            positions_share[kind][l2] = positions[i]
            biases_share[kind][l2] = biases[i]
    return DataShares(heads, tokens_share, positions_share, biases_share)


@dataclass(frozen=True)
class ReaderFields:
    """One reader layer's reading side: ``fields [3, b, h, t, e]`` and ``denominators [3, h]``
    (:func:`direction_fields`), the fields through the frozen norm scale, position-major,
    ``by_reader [3 h, t, b, e]``, and the folded reading weights ``across [3 h, e, d]`` (``W̃ᵀ``), so
    that reader r's direction field in the stream at position (t, b) is ``by_reader[r, t, b] @ across[r]``."""

    fields: Tensor
    denominators: Tensor
    by_reader: Tensor
    across: Tensor


PRODUCT_BLOCK = 1 << 20
"""Elements of one reader layer's direction fields in the stream formed at once (4 MiB in float32):
the fields and the parts are formed a few positions at a time and met at once, so that no buffer
of every part's write over the whole probe is ever held."""


def part_products(
    model: AttentionOnlyTransformer,
    tokens: Tensor,
    cache: dict[str, list[Tensor]],
    readers: list[ReaderFields],
    queries_read: Tensor,
) -> list[Tensor]:
    """Per reader layer ``l2 = 1 .. L-1``, ``[3 h, 1 + l2 h]``: every reader's direction field in
    the stream (``R = F W̃ᵀ``) dotted with each part that varies with the sequence, summed over the
    probe, ``Σ_{t, b} R[r, t, b] · x^c[t, b]``; the parts are the tokens ``W_E[tok]`` and every
    earlier head's write ``z W_O``. One sweep over blocks of positions: a block's parts (every
    head's write there, a batched GEMM), then per reader layer its fields there and their products
    with the parts (two GEMMs). The queries' fields are zero where ``queries_read [t]`` is False
    and are skipped there."""
    if not readers:
        return []
    L, H, d = model.shape.n_layers, model.shape.n_heads, model.shape.d_model
    b, t = tokens.shape
    dtype = readers[0].by_reader.dtype
    n_parts = 1 + (L - 1) * H
    embedded = model.W_E.to(dtype)[tokens.T]  # (t, b, d)
    device = tokens.device
    # every head that writes for a later layer, in part order: mixed values and output weights
    mixed = torch.stack([cache["z"][l1].to(dtype).permute(1, 2, 0, 3) for l1 in range(L - 1)]).flatten(0, 1)
    writing = torch.stack([model.layers[l1].W_O.to(dtype) for l1 in range(L - 1)]).flatten(0, 1)  # (parts-1, e, d)
    products = [torch.zeros(3 * H, 1 + l2 * H, dtype=dtype, device=device) for l2 in range(1, L)]
    per_block = max(1, PRODUCT_BLOCK // (3 * H * b * d))  # positions a block
    buffer = torch.empty(n_parts * min(per_block, t) * b * d, dtype=dtype, device=device)  # one block's parts
    changes = (torch.nonzero(queries_read[1:] != queries_read[:-1]).flatten() + 1).tolist()
    for run_start, run_end in zip([0, *changes], [*changes, t]):
        first = 0 if bool(queries_read[run_start]) else H  # readers from this one on: Q's are 0 here
        for start in range(run_start, run_end, per_block):
            end = min(start + per_block, run_end)
            n = (end - start) * b
            parts = buffer[: n_parts * n * d].view(n_parts, n, d)
            parts[0].copy_(embedded[start:end].reshape(n, d))
            torch.bmm(mixed[:, start:end].reshape(n_parts - 1, n, -1), writing, out=parts[1:])
            flat = parts.view(n_parts, -1)
            for l2, (reader, product) in enumerate(zip(readers, products), start=1):
                field = reader.by_reader[first:, start:end].reshape(3 * H - first, n, -1) @ reader.across[first:]
                product[first:].addmm_(field.view(3 * H - first, -1), flat[: 1 + l2 * H].T)
    return products


def direction_fields(
    q, k, v, pattern, to_logits, w, causal, over_sequences: bool, pairs: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(fields [3, b, h, t, e], denominators [3, h])`` for Q, K and V: the reading side's direction
    at each position (what a part's ``x^c W̃ / σ`` is dotted with) and each share's denominator.
    ``q, k, v [b, h, t, e]``, ``pattern [b, h, t, t]``, ``to_logits [h, e, vocab]``: the reader's
    ``W_O`` through the folded unembedding, the metric of V; ``w [b, 1, t, 1]`` the weighed positions;
    ``over_sequences``: the scores (V: the writes) also centred over the sequences; ``pairs [t, t]``
    which keys of a weighed row weigh (Q, K; None: all). Both centrings are orthogonal projections
    ``P``, so a part's numerator ``Σ (P s^c) ⊙ W ⊙ (P s)`` is its raw term's product with
    ``P(W ⊙ P s)``, ``W`` the weights. V in ``d_head`` space: the direct logits are ``z_i M`` with
    ``M = W_O W̃_U``, so only ``M Mᵀ [e, e]`` meets the vocabulary."""
    e = q.shape[-1]
    scores = (q @ k.mT / math.sqrt(e)).masked_fill(~causal, 0.0)  # (b, h, i, j)
    counts = causal.sum(-1, keepdim=True).to(scores.dtype)  # keys per row
    centred = (scores - scores.sum(-1, keepdim=True) / counts).masked_fill(~causal, 0.0)
    if over_sequences:
        centred = centred - centred.mean(0, keepdim=True)
    weighed = centred * w  # rows that weigh
    if pairs is not None:
        weighed = weighed * pairs  # and of each, only these keys
    scores_denominator = (weighed * centred).sum((0, 2, 3))
    if pairs is not None:  # back in the row centring's range
        weighed = (weighed - weighed.sum(-1, keepdim=True) / counts).masked_fill(~causal, 0.0)
    if over_sequences:  # back in the centring's range where the rows differ between sequences (else a no-op)
        weighed = weighed - weighed.mean(0, keepdim=True)
    z = pattern @ v  # (b, h, t, e): each head's mix of values; its direct logits are z M
    if over_sequences:  # minus each position's mean over the sequences
        z = z - z.mean(0, keepdim=True)
    else:  # minus the weighed mean over positions and sequences
        z = z - (z * w).sum((0, 2), keepdim=True) / w.sum()
    gram = to_logits @ to_logits.mT  # (h, e, e): M Mᵀ
    written = (z @ gram) * w  # (b, h, t, e): M (ℓ_i − ℓ̄), where positions weigh
    if over_sequences:
        written = written - written.mean(0, keepdim=True)
    fields = torch.stack(
        [
            weighed @ k / math.sqrt(e),  # Q: h_i = Σ_j s̃_ij k_j / √e
            weighed.mT @ q / math.sqrt(e),  # K: g_j = Σ_i s̃_ij q_i / √e
            pattern.mT @ written,  # V: M u_j, u_j = Σ_i A_ij w_i (ℓ_i − ℓ̄)
        ]
    )
    denominators = torch.stack([scores_denominator, scores_denominator, (written * z).sum((0, 2, 3))])
    return fields, denominators
