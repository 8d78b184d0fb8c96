"""Clusters of the heads' LLC curves against their types, on curves whose families are known: the
ARI against scikit-learn's documented values, planted families found, and no structure in noise."""

from __future__ import annotations

import numpy as np
import pytest

from metrics.dynamics.head_clusters import adjusted_rand_index, cluster_agreement

STEPS = np.unique(np.concatenate([np.geomspace(1, 2000, 30).round(), np.arange(0, 2001, 100)]))


@pytest.mark.parametrize(
    "a, b, ari",
    [  # scikit-learn's adjusted_rand_score documentation
        ([0, 0, 1, 1], [0, 0, 1, 1], 1.0),
        ([0, 0, 1, 1], [1, 1, 0, 0], 1.0),
        ([0, 0, 1, 2], [0, 0, 1, 1], 0.5714285714285714),
        ([0, 0, 1, 1], [0, 1, 0, 1], -0.5),
        ([0, 0, 0, 0], [0, 1, 2, 3], 0.0),
    ],
)
def test_the_adjusted_rand_index_has_its_known_values(a, b, ari):
    assert adjusted_rand_index(np.array(a), np.array(b)) == pytest.approx(ari, abs=1e-12)


def family(kind: int, steps: np.ndarray, rng) -> np.ndarray:
    """One head's curve of family ``kind``: a rise at step ~100, a rise at ~1000, or a rise then a fall;
    a random level and height, and noise of a tenth of the height."""
    x = np.log1p(steps)
    height = rng.uniform(0.5, 2.0)
    shapes = [
        1 / (1 + np.exp(-(x - np.log(100)) * 4)),
        1 / (1 + np.exp(-(x - np.log(1000)) * 4)),
        np.exp(-((x - np.log(150)) ** 2) / 0.5),
    ]
    return rng.uniform(5, 20) + height * shapes[kind] + 0.1 * height * rng.standard_normal(len(steps))


def test_planted_families_are_found_in_20_of_20_draws():
    found = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        types = rng.permutation(np.repeat([0, 1, 2], [3, 3, 2]))  # 8 heads, as 2 layers x 4
        curves = np.stack([family(kind, STEPS, rng) for kind in types])
        agreement = cluster_agreement(STEPS, curves, types, permutations=200, seed=seed)
        found += agreement.ari == 1.0 and agreement.p < 0.05
    assert found == 20


def test_curves_of_one_family_with_types_that_do_not_show_in_them_agree_at_chance():
    """Every head's curve from one family (the types cannot be seen in the curves): the ARI is the
    null's, significant (p < 0.05) in at most 3 of 40 draws."""
    significant, aris = 0, []
    for seed in range(40):
        rng = np.random.default_rng(100 + seed)
        types = rng.permutation(np.repeat([0, 1, 2], [3, 3, 2]))
        curves = np.stack([family(0, STEPS, rng) for _ in types])
        agreement = cluster_agreement(STEPS, curves, types, permutations=200, seed=seed)
        significant += agreement.p < 0.05
        aris.append(agreement.ari)
    assert significant <= 3 and abs(np.mean(aris)) < 0.1
