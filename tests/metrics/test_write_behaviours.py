"""The behaviours read from what a head writes (copying, OV copying, successor): planted heads score 1 on
their own behaviour and no more than their null on the others (and on the attention-side behaviours),
the successor score equals a dense loop over the full OV circuit, and the null is made without touching
the process's random stream."""

from __future__ import annotations

import math

import pytest
import torch

from data.probe import ProbeBatch, make_probe_batch
from metrics.heads.behaviour import (
    MIN_EXCESS,
    MIN_Z,
    applicable_behaviours,
    behaviour_scores,
    behaviour_targets,
    null_from_random_patterns,
)
from metrics.heads.behaviours.base import behaviours_reading
from metrics.heads.behaviours.successor import successor_scores
from metrics.heads.writes import probe_writes, random_model_null, write_scores
from metrics.snapshot import take_snapshot
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import SHARP, random_model

N_RANDOM, N = 23, 8  # task ids 0..22, BOS 23; a probe block of 8
WRITES = tuple(behaviours_reading("writes"))
PLANTED = {0: "copying", 1: "successor"}  # head -> the write-side behaviour it is built for
ALSO = {"copying": {"ov_copying"}}  # the same behaviour read two ways (the write on the probe, the OV circuit)


def planted_model() -> AttentionOnlyTransformer:
    """One layer of three heads that all attend (nearly one-hot) two tokens back, by position (query 1: BOS):
    a key no built-in attention behaviour targets. Residual blocks ``TOKEN`` (the only block ``W_U`` reads) and ``POS``.
    Head 0 writes the token it reads (``W_E W_OV W_U = I``: copying), head 1 its successor (``t -> t + 1``
    over the task's ids, cyclically, BOS to itself), head 2 random Gaussian ``W_V``, ``W_O``."""
    V, P = N_RANDOM + 1, 2 * N + 1
    TOKEN, POS = 0, V
    shape = TransformerShape(n_layers=1, n_heads=3, d_model=V + P, d_head=max(V, P), n_ctx=P, d_vocab=V)
    model = AttentionOnlyTransformer(shape).double()
    successor = torch.zeros(V, V, dtype=torch.float64)
    successor[torch.arange(N_RANDOM), (torch.arange(N_RANDOM) + 1) % N_RANDOM] = 1.0
    successor[N_RANDOM, N_RANDOM] = 1.0
    layer = model.layers[0]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_E[:, TOKEN : TOKEN + V] = torch.eye(V)
        model.W_pos[:, POS : POS + P] = torch.eye(P)
        model.W_U[TOKEN : TOKEN + V, :] = torch.eye(V)
        layer.W_Q[:, POS : POS + P, :P] = SHARP * shape.d_head**0.5 * torch.eye(P)  # query at p ...
        layer.W_K[:, POS : POS + P - 2, 2:P] = torch.eye(P - 2)  # ... matches the key at p - 2
        layer.W_K[:, POS, 1] = 1.0  # and query 1, which has no key two back, BOS
        for head, ov in ((0, torch.eye(V)), (1, successor)):
            layer.W_V[head, TOKEN : TOKEN + V, :V] = torch.eye(V)
            layer.W_O[head, :V, TOKEN : TOKEN + V] = ov
        for name in ("W_V", "W_O"):
            w = getattr(layer, name)
            w[2] = torch.randn(w[2].shape, generator=generator, dtype=w.dtype) / math.sqrt(w.shape[1])
    return model


def distinct_probe() -> ProbeBatch:
    """The default probe's rows whose block holds no token twice (no chance duplicate or prefix match)."""
    probe = make_probe_batch(3, 48, N, N_RANDOM)
    block = probe.tokens[:, 1 : 1 + N]
    keep = (block[:, :, None] == block[:, None, :]).sum((-1, -2)) == N
    return ProbeBatch(probe.tokens[keep], N, probe.first_start)


def test_planted_heads_score_one_on_their_write_behaviour_and_no_more_than_the_null_elsewhere():
    model, probe = planted_model(), distinct_probe()
    writes = probe_writes(model, probe.tokens, probe.first_start, N_RANDOM, torch.float64)
    scores = write_scores(writes, WRITES)[0]  # (heads, behaviours)
    null = random_model_null(model.shape, probe.tokens, probe.first_start, N_RANDOM, WRITES)
    margins = null.margins(scores)
    for head, name in PLANTED.items():
        own = WRITES.index(name)
        assert scores[head, own].item() == pytest.approx(1.0, abs=1e-9), name  # copying: up to 1e-13 leakage
        assert margins[head, own] > MIN_Z and scores[head, own] - null.mean[own] > MIN_EXCESS
        for other, other_name in enumerate(WRITES):
            if other != own and other_name not in ALSO.get(name, ()):  # never clears another's null by a type's margins
                assert not (margins[head, other] > MIN_Z and scores[head, other] - null.mean[other] > MIN_EXCESS), (
                    name,
                    other_name,
                    scores[head, other].item(),
                    null.mean[other].item(),
                )
    assert scores[0, WRITES.index("ov_copying")].item() == pytest.approx(1.0, abs=1e-9)  # every eigenvalue 1
    # the cycle's eigenvalues are the 23rd roots of unity (they sum to 0), BOS's fixed point is 1: 1 / 24
    assert scores[1, WRITES.index("ov_copying")].item() == pytest.approx(1 / (N_RANDOM + 1), abs=1e-9)
    # where they attend (two back) is none of the attention-side behaviours: no type for any head
    targets = behaviour_targets(probe.tokens, N_RANDOM)
    applicable = applicable_behaviours(targets)
    attention = behaviour_scores(writes.patterns[0].double(), targets)  # (heads, behaviours)
    attention_null = null_from_random_patterns(targets, draws=50)
    cleared = (attention_null.margins(attention) > MIN_Z) & (attention - attention_null.mean > MIN_EXCESS)
    columns = [targets.names.index(name) for name in applicable]
    assert not cleared[:, columns].any()


def test_the_successor_score_is_a_dense_loop_over_the_full_ov_circuit():
    """Per head, ``W_E W_V W_O W_U`` built densely from the raw weights (final norm's gain, LayerNorm's
    centring), and for each task token the top logit among the task's ids counted against ``t + 1``."""
    for normalization in ("none", "layernorm", "rmsnorm"):
        model = random_model(normalization, n_layers=2, n_heads=3).double()
        n_random = model.shape.d_vocab - 1
        writes = probe_writes(model, make_probe_batch(0, 2, 4, n_random).tokens, 1, n_random, torch.float64)
        got = successor_scores(model, writes.circuits, n_random)
        W_E = model.W_E.detach()
        gain = getattr(model.final_norm, "weight", None)
        W_U = model.W_U.detach() if gain is None else gain.detach()[:, None] * model.W_U.detach()
        if normalization == "layernorm":
            W_U = W_U - W_U.mean(0, keepdim=True)
        for l, layer in enumerate(model.layers):
            read_gain = getattr(layer.norm, "weight", None)
            for h in range(model.shape.n_heads):
                W_V = (
                    layer.W_V[h].detach() if read_gain is None else read_gain.detach()[:, None] * layer.W_V[h].detach()
                )
                if normalization == "layernorm":
                    W_V = W_V - W_V.mean(0, keepdim=True)
                full = W_E @ W_V @ layer.W_O[h].detach() @ W_U  # (v, v)
                hits = [int(full[t, :n_random].argmax()) == t + 1 for t in range(n_random - 1)]
                assert got[l, h].item() == pytest.approx(sum(hits) / len(hits), abs=1e-12), (normalization, l, h)


def test_the_null_leaves_the_processs_random_stream_as_it_was_and_the_snapshot_logs_every_write_behaviour():
    model, probe = planted_model(), distinct_probe()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    null = random_model_null(model.shape, probe.tokens, probe.first_start, N_RANDOM, WRITES)
    assert torch.equal(torch.get_rng_state(), before)
    assert null.mean.shape == null.std.shape == (len(WRITES),) and (null.std > 0).all()
    assert null.mean[WRITES.index("successor")] == pytest.approx(1 / N_RANDOM, abs=0.05)  # chance: 1 / n ids
    snap = take_snapshot(model, probe, composition={"baseline_samples": 20}, writes=True)
    keys = {key for output in snap.outputs for key in [getattr(output, "name", "")]}
    assert {f"heads/{name}" for name in ("copying", "ov_copying", "successor")} <= keys
    assert snap["writes"].score("successor")[0, 1].item() == pytest.approx(1.0)
