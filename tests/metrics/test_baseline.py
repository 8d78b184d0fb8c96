"""Random baselines: the d_head-space sampler has the law of the direct Gaussian sampler, and the
disk cache is keyed, shared and robust."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from metrics.composition import baseline as baseline_module
from metrics.composition.baseline import random_baselines, sample_pair_stats
from metrics.composition.measures import WEIGHT_MEASURES, aligned_pair_stats
from metrics.disk_cache import CACHE_ENV
from tests.helpers import random_low_rank

SHAPES = [(64, 16), (24, 16), (16, 16), (12, 3)]  # d - r >= r, 0 < d - r < r, d = r, rank 3 in 12


@pytest.mark.parametrize("d_model, d_head", SHAPES)
def test_d_head_sampler_has_the_law_of_gaussian_factors(d_model, d_head):
    """Every measure's mean and spread agree between the cheap sampler and random d_model x d_head
    Gaussian factors (independent draws: within 4.5 combined standard errors)."""
    n = 4000
    cheap = sample_pair_stats(d_model, d_head, n, seed=1)
    g = torch.Generator().manual_seed(2)
    direct = aligned_pair_stats(random_low_rank(n, d_model, d_head, g), random_low_rank(n, d_model, d_head, g))
    for name, measure in WEIGHT_MEASURES.items():
        a, b = measure.score(cheap), measure.score(direct)
        a, b = a[a.isfinite()], b[b.isfinite()]
        se = math.hypot(a.std() / math.sqrt(len(a)), b.std() / math.sqrt(len(b)))
        assert abs(a.mean() - b.mean()) < 4.5 * se, (name, a.mean().item(), b.mean().item())
        assert a.std().item() == pytest.approx(b.std().item(), rel=0.1, abs=1e-6), (
            name
        )  # same spread, not just the same mean


def test_baselines_match_known_values():
    base = random_baselines(64, 16, 2000, 0)
    assert base["frobenius"].mean == pytest.approx(64**-0.5, rel=0.05)
    assert base["subspace"].mean == pytest.approx(16 / 64, rel=0.02)  # E Σcos²θ / r = r / d
    assert base["whitened"] == base["token_space"] == base["frobenius"]  # Gaussian weights are isotropic already
    assert all(0 < b.stderr < 0.02 * b.mean for b in base.values())


def test_disk_cache_is_written_then_read(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    random_baselines.cache_clear()
    cold = random_baselines(96, 8, 300, 5)
    files = list((tmp_path / "baselines").glob("*.json"))
    assert len(files) == 1 and "d96-r8-n300-seed5" in files[0].name
    assert json.loads(files[0].read_text())["frobenius"]["mean"] == cold["frobenius"].mean
    random_baselines.cache_clear()
    calls = []
    monkeypatch.setattr(baseline_module, "sample_pair_stats", lambda *a: calls.append(a))
    assert random_baselines(96, 8, 300, 5) == cold and not calls  # warm: read, not resampled
    random_baselines.cache_clear()


def test_a_torn_cache_file_is_recomputed_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    random_baselines.cache_clear()
    good = random_baselines(40, 4, 200, 0)
    path = next((tmp_path / "baselines").glob("*.json"))
    path.write_text(path.read_text()[:20])  # a crash mid-write by an older, non-atomic writer
    random_baselines.cache_clear()
    assert random_baselines(40, 4, 200, 0) == good
    assert json.loads(path.read_text())  # rewritten whole
    random_baselines.cache_clear()


def test_an_unwritable_cache_warns_and_still_returns(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    random_baselines.cache_clear()
    with pytest.warns(UserWarning, match="could not cache"):
        assert random_baselines(32, 4, 100, 0)["frobenius"].mean > 0
    random_baselines.cache_clear()


def test_sampler_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    sample_pair_stats(32, 8, 50, 7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_paper_scale_baselines_are_cheap(tmp_path, monkeypatch):
    """d_model 768, d_head 64, 2000 samples, every measure: seconds cold, milliseconds warm (loose
    bounds; docs/results.md's figures come from ``python -m bench.baselines``)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    random_baselines.cache_clear()
    start = time.perf_counter()
    random_baselines(768, 64, 2000, 0)
    cold = time.perf_counter() - start
    random_baselines.cache_clear()
    start = time.perf_counter()
    random_baselines(768, 64, 2000, 0)
    warm = time.perf_counter() - start
    random_baselines.cache_clear()
    assert cold < 30 and warm < 0.5, (cold, warm)
