"""What every head writes: the scores of the behaviours read from a head's write (its direct effect on the
logits, its OV circuit: ``reads = "writes"`` in :mod:`metrics.heads.behaviours`) and their null.

The null is what these scores read where nothing is learnt: the heads of randomly initialised models of
the same shape (Gaussian weights, the project's fan-in initialisation), scored on the same probe. The
write-side scores are ratios or argmax counts, so the weights' scale does not enter them, and a head that
has learnt nothing reads as one of these. The null depends on the shape and the probe alone: a run computes it
once, and keeps it in the disk cache (:mod:`metrics.disk_cache`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from metrics.composition.circuits import head_circuits
from metrics.disk_cache import cache_file, read_json, write_json
from metrics.heads.behaviour import Null
from metrics.heads.behaviours.base import HeadWrites, behaviour_kinds
from models.transformer import AttentionOnlyTransformer, TransformerShape

NULL_HEADS = 200
"""Random heads behind a write-side null (as many models as it takes to have this many heads)."""

NULL_CACHE_VERSION = 1
"""Bump when a write-side score or :func:`random_model_null` changes, so stale files are not read."""


def write_scores(writes: HeadWrites, names: Sequence[str]) -> Tensor:
    """Every head's score on each behaviour of ``names``: ``[n_layers, n_heads, behaviours]``, float64 on the CPU."""
    kinds = behaviour_kinds()
    return torch.stack([kinds[name].score(writes).detach().cpu().double() for name in names], dim=-1)


def probe_writes(
    model: AttentionOnlyTransformer, tokens: Tensor, first_query: int, n_random: int, dtype: torch.dtype | None
) -> HeadWrites:
    """``model``'s :class:`HeadWrites` on ``tokens [b, t]``: one probe pass that keeps every head's write."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, head_out=True)
    return HeadWrites(
        model,
        tokens,
        torch.stack(cache["pattern"]),
        torch.stack(cache["head_out"]),
        first_query,
        n_random,
        head_circuits(model, dtype),
    )


def random_model_null(
    shape: TransformerShape, tokens: Tensor, first_query: int, n_random: int, names: Sequence[str], seed: int = 0
) -> Null:
    """The scores of :data:`NULL_HEADS` heads of fan-in initialised models of ``shape`` (float64, on the CPU)
    on ``tokens`` -> their mean and std per behaviour of ``names``, ``[behaviours]``. The models are drawn
    from a generator of their own: the process's random stream is left as it was."""
    draws = math.ceil(NULL_HEADS / (shape.n_layers * shape.n_heads))
    scores = []
    with torch.random.fork_rng(devices=[]):  # the CPU's generator saved and given back; no device's touched
        torch.default_generator.manual_seed(seed)
        for _ in range(draws):
            model = AttentionOnlyTransformer(shape, device="cpu").double().eval()
            writes = probe_writes(model, tokens.cpu(), first_query, n_random, torch.float64)
            scores.append(write_scores(writes, names).flatten(0, 1))  # (heads, behaviours)
    pooled = torch.cat(scores)
    return Null(pooled.mean(0), pooled.std(0))


def cached_random_model_null(
    shape: TransformerShape, tokens: Tensor, first_query: int, n_random: int, names: Sequence[str], seed: int = 0
) -> Null:
    """:func:`random_model_null`, kept in the disk cache under a digest of its arguments."""
    key = hashlib.sha256(np.ascontiguousarray(tokens.cpu().numpy()).tobytes())
    key.update(repr((shape, tuple(tokens.shape), first_query, n_random, tuple(names), NULL_HEADS, seed)).encode())
    path = cache_file("write_nulls", f"v{NULL_CACHE_VERSION}-{key.hexdigest()[:32]}")
    stored = read_json(path)
    if isinstance(stored, dict) and all(len(stored.get(part) or ()) == len(names) for part in ("mean", "std")):
        return Null(*(torch.tensor(stored[part], dtype=torch.float64, device="cpu") for part in ("mean", "std")))
    null = random_model_null(shape, tokens, first_query, n_random, names, seed)
    write_json(path, {"mean": null.mean.tolist(), "std": null.std.tolist()}, "the write-side behaviours' null")
    return null
