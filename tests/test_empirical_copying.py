"""Empirical copying scores against a per-position loop over the model's own forward pass, and on
the hand-built induction head, which copies exactly."""

from __future__ import annotations

import pytest
import torch

from data.probe import ProbeBatch, make_probe_batch
from metrics.heads.circuit_scores import folded_unembedding
from metrics.heads.empirical_copying import empirical_copying
from metrics.snapshot import take_snapshot
from tests.conftest import random_model
from tests.hand_built import induction_circuit_model


def loop_reference(model, tokens, first_query):
    """Per head, batch row and query: the head's write from ``layer.head_outputs``, unembedded by
    hand with the final gain; the share of the positive centred raise on the top-attended token,
    and whether that token is raised most."""
    L, H = model.shape.n_layers, model.shape.n_heads
    gain = getattr(model.final_norm, "weight", None)
    W_U = model.W_U.detach().double()
    W_U = W_U if gain is None else gain.detach().double()[:, None] * W_U
    scores, rates = torch.zeros(L, H, dtype=torch.float64), torch.zeros(L, H, dtype=torch.float64)
    with torch.no_grad():
        x = model.embed(tokens)
        for l, layer in enumerate(model.layers):
            pattern = layer.pattern(x)
            outputs = layer.head_outputs(x, pattern)  # (b, h, t, d)
            for h in range(H):
                shares, tops = [], []
                for b in range(tokens.shape[0]):
                    for q in range(first_query, tokens.shape[1]):
                        logits = outputs[b, h, q].double() @ W_U
                        raised = torch.clamp(logits - logits.mean(), min=0)
                        token = tokens[b, int(pattern[b, h, q].argmax())]
                        shares.append(2 * (raised[token] / raised.sum() if raised.sum() > 0 else 0.0) - 1)
                        tops.append(float(raised[token] > 0 and int(raised.argmax()) == int(token)))
                scores[l, h] = torch.tensor(shares).mean()
                rates[l, h] = torch.tensor(tops).mean()
            x = x + outputs.sum(1)
    return scores, rates


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_empirical_copying_matches_a_per_position_loop(normalization):
    model = random_model(normalization, n_layers=2, n_heads=3)
    probe = make_probe_batch(0, 3, 8, 10)  # d_vocab 11: 10 random tokens + BOS
    snap = take_snapshot(model, probe, baseline_samples=20)
    scores, rates = loop_reference(model, probe.tokens, 1)
    torch.testing.assert_close(snap.empirical_copying, scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(snap.copying_top_rate, rates)
    assert 0 < rates.mean() < 1  # neither reading is vacuous on random heads


def test_hand_built_induction_head_copies_what_it_attends_to():
    model = induction_circuit_model()
    tokens = torch.tensor([[8, 0, 1, 2, 3, 0, 1, 2, 3], [8, 5, 7, 6, 4, 5, 7, 6, 4]])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    head_out, pattern = torch.stack(cache["head_out"]), torch.stack(cache["pattern"])
    W_U = folded_unembedding(model)
    on_repeats = empirical_copying(head_out, pattern, tokens, W_U, first_query=5)
    assert on_repeats.score[1, 0].item() > 0.99  # one-hot attention, writes TOKEN -> OUT, read by W_U as that token
    assert on_repeats.top_rate[1, 0].item() == 1.0
    everywhere = empirical_copying(head_out, pattern, tokens, W_U)
    assert everywhere.score[0, 0].item() == pytest.approx(-1.0)  # writes PREV, which W_U never reads
    assert everywhere.top_rate[0, 0].item() == 0.0
    snap = take_snapshot(model, ProbeBatch(tokens=tokens, n=4, first_start=1), baseline_samples=20)
    torch.testing.assert_close(snap.empirical_copying, everywhere.score.double())
