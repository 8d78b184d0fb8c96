"""A two-layer model whose weights implement an induction circuit by hand.

Residual stream blocks (``V = d_vocab`` dims each, plus ``n_ctx`` for positions):
``TOKEN`` (the token's one-hot), ``POS`` (position one-hot), ``PREV`` (previous token, written by
L0H0), ``OUT`` (the induction head's prediction, read by the unembedding).

- L0H0, previous-token head: queries read position p, keys position p - 1; copies TOKEN -> PREV.
- L1H0, induction head: queries read TOKEN, keys read PREV (K-composition with L0H0);
  copies TOKEN -> OUT.
- L0H1 and L1H1: small random distractors.
"""

from __future__ import annotations

import torch

from models.transformer import AttentionOnlyTransformer, TransformerShape

SHARP = 30.0  # attention logit scale: makes the hand-built patterns nearly one-hot


def induction_circuit_model(d_vocab: int = 9, n_ctx: int = 9, seed: int = 0) -> AttentionOnlyTransformer:
    V, P = d_vocab, n_ctx
    d_model, d_head = 3 * V + P, max(V, P)
    TOKEN, POS, PREV, OUT = 0, V, V + P, 2 * V + P
    model = AttentionOnlyTransformer(
        TransformerShape(n_layers=2, n_heads=2, d_model=d_model + V, d_head=d_head, n_ctx=P, d_vocab=V)
    )
    d_model += V  # the OUT block
    generator = torch.Generator().manual_seed(seed)
    eye = lambda n: torch.eye(n)
    scale = SHARP * d_head**0.5
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_E[:, TOKEN : TOKEN + V] = eye(V)
        model.W_pos[:, POS : POS + P] = eye(P)
        prev, ind = model.layers[0], model.layers[1]
        # L0H0: query at p matches key at p - 1
        prev.W_Q[0, POS : POS + P, :P] = scale * eye(P)
        prev.W_K[0, POS : POS + P - 1, 1:P] = eye(P - 1)
        prev.W_V[0, TOKEN : TOKEN + V, :V] = eye(V)
        prev.W_O[0, :V, PREV : PREV + V] = eye(V)
        # L1H0: query's token matches key's previous token
        ind.W_Q[0, TOKEN : TOKEN + V, :V] = scale * eye(V)
        ind.W_K[0, PREV : PREV + V, :V] = eye(V)
        ind.W_V[0, TOKEN : TOKEN + V, :V] = eye(V)
        ind.W_O[0, :V, OUT : OUT + V] = eye(V)
        model.W_U[OUT : OUT + V, :] = 10.0 * eye(V)
        for layer in (prev, ind):
            for name in ("W_Q", "W_K", "W_V", "W_O"):
                w = getattr(layer, name)
                w[1] = 0.05 * torch.randn(w[1].shape, generator=generator)
    return model
