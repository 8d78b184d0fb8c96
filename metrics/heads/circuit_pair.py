"""The induction circuit pair (docs/measures.md): the earlier-layer head with the highest previous-token
score and the later-layer head with the highest induction score."""

from __future__ import annotations

from torch import Tensor


def circuit_pair(previous_token: Tensor, induction: Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((l1, h1), (l2, h2))`` from per-head scores ``[n_layers, n_heads]``; needs >= 2 layers.

    The reader is the top induction head of layers >= 1; the writer the top previous-token head
    among the layers before it.
    """
    n_layers, n_heads = induction.shape
    if n_layers < 2:
        raise ValueError("a circuit pair needs at least two layers")
    reader = int(induction[1:].flatten().argmax()) + n_heads
    l2, h2 = divmod(reader, n_heads)
    writer = int(previous_token[:l2].flatten().argmax())
    l1, h1 = divmod(writer, n_heads)
    return (l1, h1), (l2, h2)
