"""The copying behaviour (``heads/copying``): Olsson et al. 2022's copying evaluator against an independent
per-position loop on hand-built copying, anti-copying and random heads; against a loop over the model's
own forward pass through the tracker's snapshot; the hand-built induction head."""

from __future__ import annotations

import math

import pytest
import torch

from data.probe import ProbeBatch, make_probe_batch
from metrics.heads.behaviours.copying import copying_evaluator
from metrics.heads.circuit_scores import folded_unembedding
from metrics.snapshot import take_snapshot
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import SHARP, induction_circuit_model, random_model

N, N_RANDOM = 6, 11  # probe: BOS + 6 random tokens + the same 6; d_vocab 12 (11 random ids + BOS)
N_RANDOM_HEADS = 24


def ov_heads_model(n_random_heads: int = N_RANDOM_HEADS, seed: int = 0) -> AttentionOnlyTransformer:
    """One layer whose heads all attend (nearly one-hot) to the previous token, by position.

    Residual blocks: ``TOKEN`` (the token's one-hot, the only block ``W_U`` reads) and ``POS``.
    Head 0 copies, ``W_E W_OV W_U = +I``; head 1 anti-copies, ``-I``; heads 2.. have Gaussian
    ``W_V``, ``W_O`` over the whole stream.
    """
    V, P = N_RANDOM + 1, 2 * N + 1
    TOKEN, POS = 0, V
    shape = TransformerShape(
        n_layers=1, n_heads=2 + n_random_heads, d_model=V + P, d_head=max(V, P), n_ctx=P, d_vocab=V
    )
    model = AttentionOnlyTransformer(shape).double()
    generator = torch.Generator().manual_seed(seed)
    layer = model.layers[0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_E[:, TOKEN : TOKEN + V] = torch.eye(V)
        model.W_pos[:, POS : POS + P] = torch.eye(P)
        model.W_U[TOKEN : TOKEN + V, :] = torch.eye(V)
        layer.W_Q[:, POS : POS + P, :P] = SHARP * shape.d_head**0.5 * torch.eye(P)  # query at p ...
        layer.W_K[:, POS : POS + P - 1, 1:P] = torch.eye(P - 1)  # ... matches the key at p - 1
        for head, sign in ((0, 1.0), (1, -1.0)):
            layer.W_V[head, TOKEN : TOKEN + V, :V] = torch.eye(V)
            layer.W_O[head, :V, TOKEN : TOKEN + V] = sign * torch.eye(V)
        for name in ("W_V", "W_O"):
            w = getattr(layer, name)
            w[2:] = torch.randn(w[2:].shape, generator=generator, dtype=w.dtype) / math.sqrt(w.shape[1])
    return model


def paper_copying_reference(model: AttentionOnlyTransformer, tokens: torch.Tensor, first_query: int) -> torch.Tensor:
    """Olsson et al. 2022's copying evaluator for a one-layer, norm-free model, from the raw weights
    in float64, one query position at a time: the head's write unembedded, minus its mean over the
    vocabulary, ReLU; the raise of the token at the most-attended key over the raise summed over the
    distinct tokens of the sequence; 2 r - 1, averaged over sequences and positions."""
    (layer,) = model.layers
    W_E, W_pos, W_U = (w.detach().double() for w in (model.W_E, model.W_pos, model.W_U))
    H, d_head = layer.W_Q.shape[0], layer.W_Q.shape[-1]
    scores = torch.zeros(1, H, dtype=torch.float64)
    for h in range(H):
        W_Q, W_K, W_V, W_O = (getattr(layer, name)[h].detach().double() for name in ("W_Q", "W_K", "W_V", "W_O"))
        per_position = []
        for b in range(tokens.shape[0]):
            row = [int(t) for t in tokens[b]]
            x = W_E[row] + W_pos[: len(row)]
            sample = set(row)
            for q in range(first_query, len(row)):
                logits = torch.tensor([float(x[q] @ W_Q @ (x[k] @ W_K)) / math.sqrt(d_head) for k in range(q + 1)])
                attention = torch.softmax(logits, dim=0)
                write = sum(attention[k] * (x[k] @ W_V @ W_O) for k in range(q + 1))
                head_logits = write @ W_U
                raised = torch.clamp(head_logits - head_logits.mean(), min=0.0)
                attended = row[int(attention.argmax())]
                on_sample = sum(float(raised[t]) for t in sample)
                r = float(raised[attended]) / on_sample if on_sample > 0 else 0.0
                per_position.append(2 * r - 1)
        scores[0, h] = sum(per_position) / len(per_position)
    return scores


def model_copying(model: AttentionOnlyTransformer, tokens: torch.Tensor, first_query: int):
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    return copying_evaluator(
        torch.stack(cache["head_out"]), torch.stack(cache["pattern"]), tokens, folded_unembedding(model), first_query
    )


def test_paper_copying_score_on_hand_built_copying_anti_copying_and_random_heads():
    model = ov_heads_model()
    probe = make_probe_batch(0, 16, N, N_RANDOM)
    got = model_copying(model, probe.tokens, probe.first_start)
    reference = paper_copying_reference(model, probe.tokens, probe.first_start)
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-9)
    copying, anti, random_heads = got[0, 0].item(), got[0, 1].item(), got[0, 2:]
    assert copying > 0.999  # raises the attended token and, up to 1e-13 attention leakage, nothing else
    assert anti == pytest.approx(-1.0)  # lowers the attended token: after centring every other token is raised
    # a random head raises the attended token like any of the sequence's |S| tokens: r ~ 1/|S|
    chance = torch.tensor([2 / len(set(row.tolist())) - 1 for row in probe.tokens]).mean().item()
    assert (random_heads > -1).all() and (random_heads < 0.5).all()
    assert random_heads.mean().item() == pytest.approx(chance, abs=0.1)


def test_tokens_outside_the_sample_do_not_count():
    """A head that raises the attended token by 1 and every token id absent from the sequence by
    0.5 copies perfectly among the sample's tokens: 1 under the paper's denominator (the retired
    share over the whole vocabulary read 2 / (1 + 0.5 · 94) - 1 ≈ -0.96 here)."""
    d_vocab, tokens = 100, torch.tensor([[7, 3, 5, 9, 2, 8]])
    t = tokens.shape[1]
    pattern = torch.zeros(1, 1, 1, t, t, dtype=torch.float64)
    pattern[..., 0, 0] = 1.0
    pattern[..., torch.arange(1, t), torch.arange(t - 1)] = 1.0  # previous-token attention
    absent = torch.ones(d_vocab, dtype=torch.bool)
    absent[tokens[0]] = False
    head_out = torch.zeros(1, 1, 1, t, d_vocab, dtype=torch.float64)  # d_model = d_vocab, W_U = I
    for q in range(t):
        head_out[0, 0, 0, q, absent] = 0.5
        head_out[0, 0, 0, q, tokens[0, max(q - 1, 0)]] = 1.0
    got = copying_evaluator(head_out, pattern, tokens, torch.eye(d_vocab, dtype=torch.float64))
    assert got.item() == pytest.approx(1.0)


def loop_reference(model, tokens, first_query):
    """Per head, batch row and query: the head's write from ``layer.head_outputs``, unembedded by
    hand through the final norm's linear part (centred over ``d_model`` under LayerNorm, times the
    gain); the paper's ratio (raise of the top-attended token over the raise of
    the sequence's distinct tokens, as 2 r - 1)."""
    L, H = model.shape.n_layers, model.shape.n_heads
    gain = getattr(model.final_norm, "weight", None)
    centres = isinstance(model.final_norm, torch.nn.LayerNorm)
    W_U = model.W_U.detach().double()
    W_U = W_U if gain is None else gain.detach().double()[:, None] * W_U
    scores = torch.zeros(L, H, dtype=torch.float64)
    with torch.no_grad():
        x = model.embed(tokens)
        for l, layer in enumerate(model.layers):
            pattern = layer.pattern(x)
            outputs = layer.head_outputs(x, pattern)  # (b, h, t, d)
            for h in range(H):
                ratios = []
                for b in range(tokens.shape[0]):
                    sample = sorted(set(tokens[b].tolist()))
                    for q in range(first_query, tokens.shape[1]):
                        write = outputs[b, h, q].double()
                        logits = (write - write.mean() if centres else write) @ W_U
                        raised = torch.clamp(logits - logits.mean(), min=0)
                        token = tokens[b, int(pattern[b, h, q].argmax())]
                        on_sample = raised[sample].sum()
                        ratios.append(2 * (raised[token] / on_sample if on_sample > 0 else 0.0) - 1)
                scores[l, h] = torch.tensor(ratios).mean()
            x = x + outputs.sum(1)
    return scores


@pytest.mark.parametrize("normalization", ["none", "layernorm", "rmsnorm"])
def test_the_copying_behaviour_matches_a_per_position_loop(normalization):
    model = random_model(normalization, n_layers=2, n_heads=3)
    probe = make_probe_batch(0, 3, 8, 10)  # d_vocab 11: 10 random tokens + BOS
    snap = take_snapshot(model, probe, composition={"baseline_samples": 20}, writes=True)
    scores = loop_reference(model, probe.tokens, 1)
    torch.testing.assert_close(snap["writes"].score("copying"), scores, rtol=1e-5, atol=1e-6)
    assert (-1 < scores).all() and (scores < 1).all()  # not vacuous on random heads


def test_hand_built_induction_head_copies_what_it_attends_to():
    model = induction_circuit_model()
    tokens = torch.tensor([[8, 0, 1, 2, 3, 0, 1, 2, 3], [8, 5, 7, 6, 4, 5, 7, 6, 4]])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    head_out, pattern = torch.stack(cache["head_out"]), torch.stack(cache["pattern"])
    W_U = folded_unembedding(model)
    on_repeats = copying_evaluator(head_out, pattern, tokens, W_U, first_query=5)
    assert on_repeats[1, 0].item() > 0.99  # one-hot attention, writes TOKEN -> OUT, read by W_U as that token
    everywhere = copying_evaluator(head_out, pattern, tokens, W_U)
    assert everywhere[0, 0].item() == pytest.approx(-1.0)  # writes PREV, which W_U never reads: raises nothing
    probe = ProbeBatch(tokens=tokens, n=4, first_start=1)
    snap = take_snapshot(model, probe, composition={"baseline_samples": 20}, writes=True)
    torch.testing.assert_close(snap["writes"].score("copying"), everywhere.double())
