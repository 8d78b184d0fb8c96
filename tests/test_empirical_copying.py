"""Empirical copying score against a per-position loop over the model's own forward pass, and on
the hand-built induction head, which copies exactly."""

from __future__ import annotations

import pytest
import torch

from data.probe import ProbeBatch, make_probe_batch
from metrics.circuit_scores import folded_unembedding
from metrics.empirical_copying import empirical_copying_scores
from metrics.snapshot import take_snapshot
from tests.conftest import random_model
from tests.hand_built import induction_circuit_model


def loop_reference(model, tokens, first_query):
    """Per head, batch row and query: the head's write from ``layer.head_outputs``, unembedded by
    hand with the final gain, then the share of the positive centred raise on the top-attended token."""
    L, H = model.shape.n_layers, model.shape.n_heads
    gain = getattr(model.final_norm, "weight", None)
    W_U = model.W_U.detach().double()
    W_U = W_U if gain is None else gain.detach().double()[:, None] * W_U
    scores = torch.zeros(L, H, dtype=torch.float64)
    with torch.no_grad():
        x = model.embed(tokens)
        for l, layer in enumerate(model.layers):
            pattern = layer.pattern(x)
            outputs = layer.head_outputs(x, pattern)  # (b, h, t, d)
            for h in range(H):
                values = []
                for b in range(tokens.shape[0]):
                    for q in range(first_query, tokens.shape[1]):
                        logits = outputs[b, h, q].double() @ W_U
                        raised = torch.clamp(logits - logits.mean(), min=0)
                        token = tokens[b, int(pattern[b, h, q].argmax())]
                        share = raised[token] / raised.sum() if raised.sum() > 0 else torch.tensor(0.0)
                        values.append(2 * share - 1)
                scores[l, h] = torch.stack(values).mean()
            x = x + outputs.sum(1)
    return scores


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_empirical_copying_matches_a_per_position_loop(normalization):
    model = random_model(normalization, n_layers=2, n_heads=3)
    probe = make_probe_batch(0, 3, 8, 10)  # d_vocab 11: 10 random tokens + BOS
    snap = take_snapshot(model, probe, baseline_samples=20)
    torch.testing.assert_close(snap.empirical_copying, loop_reference(model, probe.tokens, 1), rtol=1e-5, atol=1e-6)


def test_empirical_copying_vectorised_call_agrees_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    head_out = torch.randn(2, 3, 2, 5, 7, generator=g, dtype=torch.float64)  # (L, b, h, t, d)
    pattern = torch.rand(2, 3, 2, 5, 5, generator=g, dtype=torch.float64).softmax(-1)
    tokens = torch.randint(0, 4, (3, 5), generator=g)
    W_U = torch.randn(7, 4, generator=g, dtype=torch.float64)
    got = empirical_copying_scores(head_out, pattern, tokens, W_U, first_query=0)
    raised = (head_out @ W_U - (head_out @ W_U).mean(-1, keepdim=True)).clamp(min=0)
    want = torch.zeros(2, 2, dtype=torch.float64)
    for l, b, h, t in torch.cartesian_prod(*(torch.arange(n) for n in (2, 3, 2, 5))).tolist():
        token = tokens[b, pattern[l, b, h, t].argmax()]
        want[l, h] += (2 * raised[l, b, h, t, token] / raised[l, b, h, t].sum() - 1) / 15
    torch.testing.assert_close(got, want)


def test_hand_built_induction_head_copies_what_it_attends_to():
    model = induction_circuit_model()
    tokens = torch.tensor([[8, 0, 1, 2, 3, 0, 1, 2, 3], [8, 5, 7, 6, 4, 5, 7, 6, 4]])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    head_out, pattern = torch.stack(cache["head_out"]), torch.stack(cache["pattern"])
    W_U = folded_unembedding(model)
    on_repeats = empirical_copying_scores(head_out, pattern, tokens, W_U, first_query=5)
    assert on_repeats[1, 0].item() > 0.99  # one-hot attention, writes TOKEN -> OUT, read by W_U as that token
    assert empirical_copying_scores(head_out, pattern, tokens, W_U)[0, 0].item() == pytest.approx(-1.0)  # writes PREV: W_U reads none
    snap = take_snapshot(model, ProbeBatch(tokens=tokens, n=4, first_start=1), baseline_samples=20)
    torch.testing.assert_close(snap.empirical_copying, empirical_copying_scores(head_out, pattern, tokens, W_U).double())
