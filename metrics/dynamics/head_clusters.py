"""Head types from their LLC curves alone, judged against what the heads do (Wang et al. 2024,
"Differentiation and specialization of attention heads via the refined local learning coefficient":
the heads' weight-refined LLC curves cluster by head type).

Each head's curve ``[steps]`` is put on an even grid in log step (so that a run's many late
snapshots do not outweigh its few early ones), standardised (mean 0, sd 1: a curve's shape, not its
level), and the heads are clustered by agglomerative clustering (SciPy, average linkage on the
Euclidean distance between standardised curves, monotone in their correlation) into as many
clusters as there are behaviour types. The clusters are compared with the behaviour types by the
adjusted Rand index (Hubert & Arabie 1985), against its permutation null (the types shuffled over
the heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GRID_POINTS = 32
"""Points of the even log-step grid the curves are compared on."""

PERMUTATIONS = 2000
"""Shuffles of the types over the heads in the ARI's null."""


def log_step_grid(steps: np.ndarray, values: np.ndarray, points: int = GRID_POINTS) -> np.ndarray:
    """``values [heads, steps]`` at ``steps [steps]`` (increasing, >= 0) linearly interpolated in
    ``log(1 + step)`` onto ``points`` even points: ``[heads, points]``."""
    x = np.log1p(np.asarray(steps, dtype=np.float64))
    grid = np.linspace(x[0], x[-1], points)
    return np.stack([np.interp(grid, x, row) for row in np.asarray(values, dtype=np.float64)])


def standardised(curves: np.ndarray) -> np.ndarray:
    """Each row of ``curves [heads, points]`` less its mean, over its sd (a flat row: zeros)."""
    centred = curves - curves.mean(axis=1, keepdims=True)
    sd = centred.std(axis=1, keepdims=True)
    return np.divide(centred, sd, out=np.zeros_like(centred), where=sd > 1e-12)


def cluster_curves(curves: np.ndarray, clusters: int) -> np.ndarray:
    """Cluster labels ``[heads]`` (0 .. clusters - 1) of standardised ``curves [heads, points]``:
    SciPy's average-linkage hierarchy on their Euclidean distances (``√(2 n (1 - r))`` for two
    standardised curves of correlation r; defined for a flat curve too), cut at ``clusters``."""
    from scipy.cluster.hierarchy import fcluster, linkage

    n = len(curves)
    if clusters >= n:
        return np.arange(n)
    if clusters <= 1:
        return np.zeros(n, dtype=int)
    tree = linkage(curves, method="average", metric="euclidean")
    return fcluster(tree, t=clusters, criterion="maxclust") - 1


def adjusted_rand_index(a: np.ndarray, b: np.ndarray) -> float:
    """The adjusted Rand index of two labelings of the same items (Hubert & Arabie 1985): 1 for the
    same partition, 0 in expectation for independent ones. Written out (a contingency table and
    four binomial sums) rather than taken from scikit-learn, which the project does not otherwise need."""
    a, b = np.unique(a, return_inverse=True)[1], np.unique(b, return_inverse=True)[1]
    table = np.zeros((a.max() + 1, b.max() + 1))
    np.add.at(table, (a, b), 1)
    pairs = lambda x: (x * (x - 1) / 2).sum()
    together, rows, columns = pairs(table), pairs(table.sum(1)), pairs(table.sum(0))
    total = pairs(np.array([len(a)], dtype=float))
    expected = rows * columns / total if total else 0.0
    best = (rows + columns) / 2
    if best == expected:  # both partitions trivial (all in one, or all apart): they agree
        return 1.0
    return float((together - expected) / (best - expected))


@dataclass(frozen=True)
class ClusterAgreement:
    """The clusters of the heads' curves against their types: ``labels [heads]``, the ``ari``, the
    null's mean and 95th percentile and the share of shuffles at least as high (``p``)."""

    labels: np.ndarray
    ari: float
    null_mean: float
    null_95: float
    p: float


def cluster_agreement(
    steps: np.ndarray, values: np.ndarray, types: np.ndarray, permutations: int = PERMUTATIONS, seed: int = 0
) -> ClusterAgreement:
    """Cluster the heads' curves ``values [heads, steps]`` (:func:`log_step_grid`, :func:`standardised`,
    :func:`cluster_curves`) into as many clusters as ``types [heads]`` has distinct labels, and their
    ARI with the types against ``permutations`` shuffles of the types over the heads."""
    curves = standardised(log_step_grid(steps, values))
    labels = cluster_curves(curves, len(np.unique(types)))
    ari = adjusted_rand_index(labels, types)
    rng = np.random.default_rng(seed)
    null = np.array([adjusted_rand_index(labels, rng.permutation(types)) for _ in range(permutations)])
    return ClusterAgreement(
        labels, ari, float(null.mean()), float(np.quantile(null, 0.95)), float((null >= ari).mean())
    )
