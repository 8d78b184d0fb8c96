"""Counter-based randomness: every random number is a pure function of (seed, sample, slot).

A sample's tokens then depend only on ``(seed, sample_id)``, never on batch size, worker count,
DDP rank or how far an iterator has run, which makes data streams resumable and lets ranks draw
disjoint samples by drawing disjoint ids. The mixer is SplitMix64 (Steele et al. 2014).
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, elementwise on uint64 (wrapping arithmetic is intended)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def random_bits(seed: int, sample_ids: np.ndarray, n_slots: int, stream: int = 0) -> np.ndarray:
    """Independent 64-bit words ``[len(sample_ids), n_slots]`` for each (seed, stream, sample, slot).

    ``stream`` separates independent uses of the same sample (e.g. tokens vs. trigger choice).
    """
    with np.errstate(over="ignore"):
        key = _splitmix64(np.uint64(seed % 2**64) ^ _splitmix64(np.uint64(stream)))
        ids = _splitmix64(np.asarray(sample_ids, dtype=np.uint64) ^ key)  # (n,)
        slots = np.arange(n_slots, dtype=np.uint64)
        return _splitmix64(ids[:, None] * np.uint64(n_slots) + slots[None, :] ^ key)


def random_ints(seed: int, sample_ids: np.ndarray, n_slots: int, high: int, stream: int = 0) -> np.ndarray:
    """Uniform integers in ``[0, high)``, shape ``[len(sample_ids), n_slots]``, as int64."""
    return (random_bits(seed, sample_ids, n_slots, stream) % np.uint64(high)).astype(np.int64)


def random_uniform(seed: int, sample_ids: np.ndarray, n_slots: int, stream: int = 0) -> np.ndarray:
    """Uniform floats in ``[0, 1)`` from the top 53 bits, shape ``[len(sample_ids), n_slots]``."""
    bits = random_bits(seed, sample_ids, n_slots, stream) >> np.uint64(11)
    return bits.astype(np.float64) / float(2**53)
