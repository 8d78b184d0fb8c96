"""The data-aware composition share: against a dense computation of its definition (every part's
queries, keys and values built one by one), exact where it must be exact, and invariant where the
model is."""

from __future__ import annotations

import math

import pytest
import torch

import metrics.composition.data_shares as data_shares_module
from data.probe import make_probe_batch
from metrics.composition.data_shares import CENTRES, ROWS, data_shares, induction_keys, row_weights
from metrics.snapshot import take_snapshot
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import easytransformer_like, induction_circuit_model


def probe_for(model, batch: int = 4, seed: int = 0):
    n = (model.shape.n_ctx - 1) // 2
    return make_probe_batch(seed, batch, n, model.shape.d_vocab - 1, True)


def shares_of(model, probe, rows: str = "all", centre: str = "sequences", floor: float = 0.0):
    with torch.no_grad():
        _, cache = model.run_with_cache(probe.tokens, head_out=True)
    weights = row_weights(probe, rows, probe.tokens.device)
    keys = induction_keys(probe, probe.tokens.device) if rows == "induction" else None
    return data_shares(model, probe.tokens, cache, weights, centre, keys, floor)


def three_layers(normalization: str, positions: str, seed: int = 0) -> AttentionOnlyTransformer:
    torch.manual_seed(seed)
    shape = TransformerShape(3, 2, 16, 4, 13, 11, normalization, positions, True)
    model = AttentionOnlyTransformer(shape).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("b_") or "norm" in name:
                parameter.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


def frozen_norm(norm, x, part):
    """``part``'s term of ``norm(x)``: the norm with its scale frozen at ``x``'s."""
    if isinstance(norm, torch.nn.LayerNorm):
        sigma = (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
        return (part - part.mean(-1, keepdim=True)) / sigma * norm.weight
    if isinstance(norm, torch.nn.RMSNorm):
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return part / (x.square().mean(-1, keepdim=True) + eps).sqrt() * norm.weight
    return part


def row_centred(scores, causal, centre):
    """``scores [b, i, j]``, each query's minus their mean over its causal keys (0 off the causal
    mask), and with ``centre="sequences"`` then minus their mean over the sequences."""
    mean = scores.masked_fill(~causal, 0).sum(-1, keepdim=True) / causal.sum(-1, keepdim=True)
    centred = (scores - mean).masked_fill(~causal, 0)
    return centred - centred.mean(0, keepdim=True) if centre == "sequences" else centred


def centred_write(write, weights, centre):
    """``write [b, t, vocab]`` minus its mean over the sequences at each position, or its weighed mean."""
    if centre == "sequences":
        return write - write.mean(0, keepdim=True)
    weights = weights.expand(write.shape[:2])[..., None]
    return write - (write * weights).sum((0, 1)) / weights.sum()


@torch.no_grad()
def dense_shares(model, probe, rows: str, centre: str, weights=None, floor: float = 0.0) -> dict[str, dict]:
    """The definition, term by term: every part's own queries, keys and values through the reader's
    norm frozen at the probe's scale, its own scores (or write), row-centred, and its covariance
    with the whole. ``{kind: {(layer, head): {part: share}}}`` with parts ``tokens``,
    ``positions``, ``biases`` and ``(l1, h1)``. ``weights [b, t]``, if given, replace ``rows``; ``floor`` logit² a weighed pair joins the Q
    and K denominators."""
    tokens = probe.tokens
    b, t = tokens.shape
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, head_out=True)
    if weights is None:
        weights = row_weights(probe, rows, tokens.device)
    weights = weights.double()
    keys = torch.ones(t, t, dtype=torch.float64)  # which keys of a weighed row weigh
    if rows == "induction":  # each second-copy query's induction target, written out here
        keys = torch.zeros(t, t, dtype=torch.float64)
        for i in range(probe.repeat_start, probe.repeat_start + probe.n):
            keys[i, i - probe.n + 1] = 1.0
    found = {kind: {} for kind in "QKV"}
    final = model.final_norm
    gain = final.weight[:, None] if isinstance(final, (torch.nn.LayerNorm, torch.nn.RMSNorm)) else 1.0
    unembedding = gain * model.W_U  # V is read in the logits, through the final norm frozen like the others
    if isinstance(final, torch.nn.LayerNorm):  # what the final norm reads: x - mean(x)
        unembedding = unembedding - unembedding.mean(0, keepdim=True)
    for l2, layer in enumerate(model.layers):
        x = cache["resid_pre"][l2]
        parts = {"tokens": model.W_E[tokens]}
        if not model.shortformer:
            parts["positions"] = model.W_pos[:t].expand(b, t, -1)
        for l1 in range(l2):
            for h1 in range(model.shape.n_heads):
                parts[(l1, h1)] = cache["head_out"][l1][:, h1]
        bias_parts = [model.layers[l1].b_O.expand(b, t, -1) for l1 in range(l2) if model.layers[l1].b_O is not None]
        if bias_parts:
            parts["biases"] = sum(bias_parts)
        norm = layer.norm

        for h in range(model.shape.n_heads):
            W = {"Q": layer.W_Q[h], "K": layer.W_K[h], "V": layer.W_V[h]}
            bias = {"Q": layer.b_Q[h], "K": layer.b_K[h], "V": layer.b_V[h]}
            read = {
                kind: {name: frozen_norm(norm, x, part) @ W[kind] for name, part in parts.items()} for kind in "QKV"
            }
            for kind in "QK":
                read[kind]["own bias"] = bias[kind].expand(b, t, -1)
                if model.shortformer:
                    read[kind]["positions"] = (model.W_pos[:t] @ W[kind]).expand(b, t, -1)
            q, k = (sum(read[kind].values()) for kind in "QK")
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            e = q.shape[-1]

            whole = row_centred(q @ k.mT / math.sqrt(e), causal, centre) * weights[..., None].sqrt() * keys
            pattern = cache["pattern"][l2][:, h]
            to_logits = layer.W_O[h] @ unembedding  # the head's direct path to the logits
            write = pattern @ sum(read["V"].values()) @ to_logits
            whole_write = centred_write(write, weights, centre)
            for kind in "QKV":
                shares = {}
                for name, part in read[kind].items():
                    if kind == "V":
                        own = centred_write(pattern @ part @ to_logits, weights, centre)
                        numerator = (own * whole_write * weights[..., None]).sum()
                        denominator = (whole_write.square() * weights[..., None]).sum()
                    else:
                        scores = (part @ k.mT if kind == "Q" else q @ part.mT) / math.sqrt(e)
                        own = row_centred(scores, causal, centre) * weights[..., None].sqrt() * keys
                        numerator = (own * whole).sum()
                        weighed_pairs = (weights.expand(b, t)[..., None] * keys * causal).sum()
                        denominator = whole.square().sum() + floor * weighed_pairs
                    key = "biases" if name == "own bias" else name
                    shares[key] = shares.get(key, 0.0) + float(numerator / denominator)
                found[kind][(l2, h)] = shares
    return found


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("positions", ["standard", "shortformer"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("centre", CENTRES)
def test_every_share_equals_the_dense_definition_and_they_sum_to_one(normalization, positions, rows, centre):
    model = three_layers(normalization, positions)
    probe = probe_for(model)
    assert_equal_to_dense(shares_of(model, probe, rows, centre), dense_shares(model, probe, rows, centre))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("centre", CENTRES)
def test_a_floor_shares_out_the_content_variance_against_it_and_leaves_v_alone(rows, centre):
    """``floor`` logit² a weighed pair in the Q and K denominators: the definition with it, every
    part scaled by the same ``V / (V + floor)`` of its reader, V's shares untouched."""
    model = three_layers("layernorm", "standard")
    probe = probe_for(model)
    floored, exact = shares_of(model, probe, rows, centre, floor=0.5), shares_of(model, probe, rows, centre)
    dense = dense_shares(model, probe, rows, centre, floor=0.5)
    for (l2, h2), parts in dense["K"].items():
        if l2 == 0:
            continue
        for part, expected in parts.items():
            got = (
                floored.heads["K"][part[0], part[1], l2, h2]
                if isinstance(part, tuple)
                else getattr(floored, part)["K"][l2, h2]
            )
            assert float(got) == pytest.approx(expected, rel=1e-9, abs=1e-12), (l2, h2, part)
    for kind in "QK":
        factor = floored.total(kind)[1:] / exact.total(kind)[1:]  # V / (V + floor), one per reader
        assert ((factor > 0) & (factor < 1)).all()
        torch.testing.assert_close(floored.heads[kind][:, :, 1:], exact.heads[kind][:, :, 1:] * factor, equal_nan=True)
    torch.testing.assert_close(floored.heads["V"], exact.heads["V"], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("positions", ["standard", "shortformer"])
@pytest.mark.parametrize("centre", CENTRES)
def test_rows_that_weigh_may_differ_between_the_sequences(positions, centre):
    """``weights [b, t]``: each sequence its own rows (a probe whose copies start at different
    positions); the product still equals the definition."""
    model = three_layers("layernorm", positions)
    probe = probe_for(model)
    weights = (torch.rand(probe.tokens.shape, generator=torch.Generator().manual_seed(3)) < 0.4).double()
    with torch.no_grad():
        _, cache = model.run_with_cache(probe.tokens)
    shares = data_shares(model, probe.tokens, cache, weights, centre)
    assert_equal_to_dense(shares, dense_shares(model, probe, "all", centre, weights))
    same = row_weights(probe, "repeated", "cpu")
    alike = data_shares(model, probe.tokens, cache, same.expand(probe.tokens.shape), centre)
    for kind in "QKV":  # the same rows in every sequence, given as [b, t]: the [t] answer
        torch.testing.assert_close(
            alike.heads[kind], shares_of(model, probe, "repeated", centre).heads[kind], equal_nan=True
        )


def assert_equal_to_dense(shares, dense):
    """Every part's share equals the term-by-term definition, and each reader's parts sum to 1."""
    for kind in "QKV":
        total = shares.total(kind)
        assert total[0].isnan().all()  # layer 0 reads no head: not scored
        torch.testing.assert_close(total[1:], torch.ones_like(total[1:]), rtol=0, atol=1e-12)
        for (l2, h2), parts in dense[kind].items():
            if l2 == 0:
                continue
            for part, expected in parts.items():
                if isinstance(part, tuple):
                    got = shares.heads[kind][part[0], part[1], l2, h2]
                else:
                    got = getattr(shares, part)[kind][l2, h2]
                assert float(got) == pytest.approx(expected, rel=1e-9, abs=1e-12), (kind, l2, h2, part)
            assert sum(parts.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("rows", ROWS)
def test_the_shares_do_not_depend_on_how_many_positions_are_swept_at_once(monkeypatch, rows):
    """The sweep over blocks of positions (one position a block here, the queries skipped where they
    are not weighed) adds up to the same products as one block of all of them."""
    model = three_layers("layernorm", "standard")
    probe = probe_for(model)
    whole = shares_of(model, probe, rows)
    monkeypatch.setattr(data_shares_module, "PRODUCT_BLOCK", 1)
    blocked = shares_of(model, probe, rows)
    for kind in "QKV":
        torch.testing.assert_close(blocked.heads[kind], whole.heads[kind], rtol=0, atol=1e-12, equal_nan=True)
        torch.testing.assert_close(blocked.tokens[kind], whole.tokens[kind], rtol=0, atol=1e-12, equal_nan=True)


def test_a_reader_whose_keys_read_only_the_writer_gives_it_all_of_its_k_share():
    model = induction_circuit_model().double()
    with torch.no_grad():  # no distractor writes: L1H0's keys read the previous-token head's write alone
        model.layers[0].W_O[1].zero_()
    probe = probe_for(model, batch=8)
    shares = shares_of(model, probe)
    assert float(shares.heads["K"][0, 0, 1, 0]) == pytest.approx(1.0, abs=1e-12)
    assert float(shares.heads["K"][0, 1, 1, 0]) == 0.0  # a writer that writes nothing: share 0
    assert float(shares.tokens["K"][1, 0]) == pytest.approx(0.0, abs=1e-12)
    assert float(shares.tokens["Q"][1, 0]) == pytest.approx(1.0, abs=1e-12)  # its queries read the token
    assert float(shares.tokens["V"][1, 0]) == pytest.approx(1.0, abs=1e-12)  # and it copies the token
    for rows in ROWS:  # whichever rows and keys weigh
        assert float(shares_of(model, probe, rows).heads["K"][0, 0, 1, 0]) == pytest.approx(1.0, abs=1e-12), rows


@pytest.mark.parametrize("floor", [0.0, 1.0])
def test_a_change_of_basis_of_the_readers_qk_circuit_changes_no_share(floor):
    model = three_layers("layernorm", "standard")
    probe = probe_for(model)
    before = shares_of(model, probe, floor=floor)
    M = torch.randn(4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 2 * torch.eye(4)
    with torch.no_grad():
        for layer in model.layers:
            layer.W_Q.copy_(layer.W_Q @ M)
            layer.W_K.copy_(layer.W_K @ torch.linalg.inv(M).T)
            layer.b_Q.copy_(layer.b_Q @ M)
            layer.b_K.copy_(layer.b_K @ torch.linalg.inv(M).T)
    after = shares_of(model, probe, floor=floor)
    for kind in "QKV":
        torch.testing.assert_close(after.heads[kind], before.heads[kind], rtol=1e-9, atol=1e-12, equal_nan=True)
        torch.testing.assert_close(after.positions[kind], before.positions[kind], rtol=1e-9, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("floor", [0.0, 1.0])
def test_under_layernorm_a_constant_added_to_a_writers_rows_changes_no_share(floor):
    model = three_layers("layernorm", "standard")
    probe = probe_for(model)
    before, logits = shares_of(model, probe, floor=floor), model(probe.tokens)
    with torch.no_grad():
        model.layers[0].W_O[1] += 0.5  # every row of L0H1's W_O moves along 1: LayerNorm cannot see it
        model.W_E += 0.3
    torch.testing.assert_close(model(probe.tokens), logits, rtol=1e-9, atol=1e-9)
    after = shares_of(model, probe, floor=floor)
    for kind in "QKV":
        torch.testing.assert_close(after.heads[kind], before.heads[kind], rtol=1e-7, atol=1e-9, equal_nan=True)
        torch.testing.assert_close(after.tokens[kind], before.tokens[kind], rtol=1e-7, atol=1e-9, equal_nan=True)


def test_the_snapshot_scores_the_share_beside_the_weight_measures():
    model = easytransformer_like("standard", False, "layernorm")
    probe = probe_for(model)
    composition = {"measures": ["frobenius", "share"], "baseline_samples": 50}
    snap = take_snapshot(model, probe, composition=composition, share={"rows": "all", "centre": "sequences"})
    direct = shares_of(model, probe, "all")
    for kind in "QKV":
        torch.testing.assert_close(snap["composition"].scores["share"][kind], direct.heads[kind], equal_nan=True)
    assert "share" not in snap["composition"].baselines and snap["composition"].extras["share"] is not None
    with pytest.raises(ValueError, match="rows must be one of"):
        row_weights(probe, "odd", "cpu")
