"""All-pairs Q/K/V composition: this repository's engine against TransformerLens, side by side.

    python -m bench.composition [--shapes small mid large] [--repeats 3] [--threads N] [--out results.json]

Needs TransformerLens (``pip install -e '.[tl]'``). Shapes (n_layers x n_heads x d_model x d_head;
n_ctx 33, d_vocab 257, no normalization, random weights, seed 0): small 2x2x64x16, mid 4x8x256x32,
large 12x12x768x64. For each shape it prints:

- **ours**: ``metrics.snapshot.composition_of`` on the float32 model, seconds per measure (Q, K and V
  together), all measures in one call, and Frobenius K alone;
- **TransformerLens**: ``all_composition_scores(mode)`` on the same weights copied into a TL model
  (``TransformerBridge.boot_native`` on TL >= 4, ``HookedTransformer`` before), float32: K alone and
  Q+K+V (the sum of the per-mode medians); the speed-up of our Frobenius K over TL's K;
- **peak extra memory** of ours (all measures) and of TL (Q, K, V), each in a fresh subprocess:
  the peak RSS during the call minus the RSS just before it (``/proc/self/status`` VmHWM after
  resetting it through ``/proc/self/clear_refs``; ``ru_maxrss`` where that is not possible);
- **agreement** in float64: our Frobenius against TL's on every scored pair, max relative error
  (<= 1e-5 required); TL's float64 reference is computed per layer pair with TL's own
  ``composition_scores`` on slices of its ``OV`` / ``QK`` FactoredMatrix where one call over all
  pairs would need more than ``FULL_CALL_BYTES`` (at 12x12x768, ~18 GB);
- **dense spot checks**: every measure of ours against its textbook formula on dense
  ``d_model x d_model`` matrices in float64, on up to 10 random pairs, each as Q, K and V;
- **FLOPs**: ``metrics.composition.engine.composition_flops`` (n/a if absent), this machine's fp32
  GEMM rate (best of a ``[8192, 768] x [768, 768]`` matmul), and our achieved share of it.

Then the targets at 12x12x768x64: Frobenius K >= 20x faster than TL's K, all measures (Q, K,
V) <= 10 s, our peak extra memory <= 1.5 GB (GB = 1e9 bytes). Timings are medians over
``--repeats``, interleaved (ours, TL, ours, TL, ...) after one warm-up on the small shape; both sides
run under ``torch.no_grad()``, as TL's tutorials do. TL's measurement runs in its own subprocess
where it needs more than ``IN_PROCESS_TL_BYTES``; every process runs under an address-space limit
(``--mem-limit-gb``), so a shape too big for memory fails its own measurement, not the machine.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import inspect
import math
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import Tensor

from analysis.export import hooked_transformer
from bench.results_file import check_out, write_results
from data.probe import make_probe_batch
from metrics.composition.measures import WEIGHT_MEASURES
from metrics.composition.scores import composition_of
from models.transformer import AttentionOnlyTransformer, TransformerShape

KINDS = ("Q", "K", "V")
WEIGHTED = tuple(WEIGHT_MEASURES)  # the weight-based measures, each checked against the dense reference
N_CTX, D_VOCAB, SEED = 33, 257, 0
SPOT_PAIRS = 10  # random pairs checked against the dense reference, each for Q, K and V
TOLERANCE = 1e-5  # max relative error, ours vs TL (Frobenius) and vs the dense reference
IN_PROCESS_TL_BYTES = 1 << 30  # TL's float32 timing goes to a subprocess above this estimate
FULL_CALL_BYTES = 2 << 30  # TL's float64 reference goes per layer pair above this estimate
EIGEN_FLOOR = 1e-10  # whitening: eigenvalues of Σ below this times λ_max are raised to it (as metrics/)
TARGET_SPEEDUP, TARGET_SECONDS, TARGET_BYTES = 20.0, 10.0, 1.5e9
INSTALL_HINT = "pip install -e '.[tl]'"


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    n_heads: int
    d_model: int
    d_head: int

    def transformer_shape(self) -> TransformerShape:
        return TransformerShape(self.n_layers, self.n_heads, self.d_model, self.d_head, N_CTX, D_VOCAB)

    @property
    def scored_pairs(self) -> int:
        """Writer-reader head pairs with the reader in a later layer, per kind."""
        return self.n_layers * (self.n_layers - 1) // 2 * self.n_heads**2

    def __str__(self) -> str:
        return f"{self.name} {self.n_layers}x{self.n_heads}x{self.d_model}x{self.d_head}"


SHAPES = {
    s.name: s for s in (Shape("small", 2, 2, 64, 16), Shape("mid", 4, 8, 256, 32), Shape("large", 12, 12, 768, 64))
}
TARGET_SHAPE = "large"


# ---------------------------------------------------------------- models


def build_model(shape: Shape) -> AttentionOnlyTransformer:
    """Our float32 model with random weights (seed 0), in eval mode."""
    torch.manual_seed(SEED)
    return AttentionOnlyTransformer(shape.transformer_shape()).eval()


def probe_tokens() -> Tensor:
    """The tracker's probe batch layout: 32 sequences of BOS + 16 tokens + the same 16."""
    return make_probe_batch(SEED, 32, 16, 256).tokens


@torch.no_grad()
def probe_residual(model: AttentionOnlyTransformer) -> list[Tensor]:
    """Each layer's input ``[batch, pos, d_model]`` on the probe (what ``whitened_resid`` whitens by)."""
    return model.run_with_cache(probe_tokens())[1]["resid_pre"]


def require_transformer_lens() -> None:
    """Exit 2 with a one-line hint when TransformerLens is not installed."""
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        print(f"error: the composition benchmark needs TransformerLens: {INSTALL_HINT}", file=sys.stderr)
        raise SystemExit(2) from None


def tl_version() -> str:
    from importlib.metadata import version

    return version("transformer-lens")


@torch.no_grad()
def build_tl_model(model: AttentionOnlyTransformer) -> torch.nn.Module:
    """A TransformerLens model with ``model``'s weights (same layout: ``W_Q [n_heads, d_model, d_head]``,
    ``W_O [n_heads, d_head, d_model]``) and every bias zero, in ``model``'s dtype: TransformerLens 4's
    ``TransformerBridge.boot_native`` or 3's ``HookedTransformer`` (``analysis.export``)."""
    return hooked_transformer(model.state_dict(), model.shape, model.W_E.dtype)


@torch.no_grad()
def tl_matches(model: AttentionOnlyTransformer, tl: torch.nn.Module) -> tuple[bool, float]:
    """(TL's ``W_Q, W_K, W_V, W_O, W_E, W_pos, W_U`` equal ours exactly, max |Δlogit| / max |logit| on the probe)."""
    same = all(
        torch.equal(getattr(tl.blocks[l].attn, name), getattr(layer, name))
        for l, layer in enumerate(model.layers)
        for name in ("W_Q", "W_K", "W_V", "W_O")
    ) and all(torch.equal(getattr(tl, name), getattr(model, name)) for name in ("W_E", "W_pos", "W_U"))
    tokens = probe_tokens()
    ours, theirs = model(tokens), tl(tokens)
    return same, ((theirs - ours).abs().max() / ours.abs().max()).item()


# ---------------------------------------------------------------- the two sides


def ours_composition(model: AttentionOnlyTransformer, measures: tuple[str, ...], residual: list[Tensor]) -> dict:
    """``composition_of`` in the model's dtype (float32 timed, float64 the exact path)."""
    with torch.no_grad():
        return composition_of(model, measures, residual=residual, dtype=model.W_E.dtype)


def frobenius_k_alone(model: AttentionOnlyTransformer) -> tuple[Callable[[], Tensor], str]:
    """A call computing our Frobenius K-composition only, and how: ``composition_of`` computes Q, K
    and V together, so this calls the engine under it, ``composition_scores(..., kinds=("K",))``, on
    ``head_circuits(model)`` (both timed); without that engine, Q+K+V (an upper bound on K alone)."""
    try:
        from metrics.composition.circuits import head_circuits
        from metrics.composition.engine import composition_scores
    except ImportError:
        return lambda: ours_composition(model, ("frobenius",), [])["frobenius"]["K"], "Q+K+V (no K-only entry point)"
    frobenius = WEIGHT_MEASURES["frobenius"]
    dtype = model.W_E.dtype

    @torch.no_grad()
    def k_alone() -> Tensor:
        return composition_scores(head_circuits(model, dtype), frobenius, kinds=("K",))["frobenius"]["K"]

    return k_alone, "engine.composition_scores(head_circuits(model), kinds=('K',))"


@torch.no_grad()
def tl_scores(tl: torch.nn.Module, mode: str) -> Tensor:
    """TL's ``all_composition_scores(mode)`` as a tensor ``[L, H, L, H]`` (zero where not scored)."""
    scores = tl.all_composition_scores(mode)
    return getattr(scores, "scores", scores)  # TL >= 4 wraps it in CompositionScores


def tl_call_bytes(shape: Shape, itemsize: int) -> int:
    """Rough peak of one ``all_composition_scores`` call: it broadcasts both collapsed factors to
    ``[L, H, L, H, d_head, d_model]`` before multiplying them."""
    return 2 * (shape.n_layers * shape.n_heads) ** 2 * shape.d_head * shape.d_model * itemsize


@torch.no_grad()
def tl_reference(tl: torch.nn.Module, shape: Shape, mode: str) -> tuple[Tensor, str]:
    """TL's float64 scores ``[L, H, L, H]``: one ``all_composition_scores`` call, or, where that needs
    more than ``FULL_CALL_BYTES``, TL's ``composition_scores`` per (writer, reader) layer pair on
    slices of its ``OV`` / ``QK`` FactoredMatrix (what ``all_composition_scores`` computes, in pieces)."""
    if tl_call_bytes(shape, 8) <= FULL_CALL_BYTES:
        return tl_scores(tl, mode), "all_composition_scores"
    try:
        from transformer_lens.utilities import composition_scores
    except ImportError:
        from transformer_lens.utils import composition_scores
    ov, qk = tl.OV, tl.QK
    reader = {"Q": lambda l: qk[l], "K": lambda l: qk[l].T, "V": lambda l: ov[l]}[mode]
    L, H = shape.n_layers, shape.n_heads
    scores = torch.zeros(L, H, L, H, dtype=torch.float64)
    for l1 in range(L):
        for l2 in range(l1 + 1, L):
            scores[l1, :, l2, :] = composition_scores(ov[l1], reader(l2), broadcast_dims=True)
    return scores, "composition_scores per layer pair"


# ---------------------------------------------------------------- timing and memory


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation that failed under the address-space limit (or for real)."""
    text = str(error)
    return isinstance(error, MemoryError) or "can't allocate memory" in text or "not enough memory" in text


def time_interleaved(
    jobs: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Median seconds of each job over ``repeats`` rounds, jobs interleaved within a round. A job that
    runs out of memory is dropped and reported in the second dict."""
    samples: dict[str, list[float]] = {name: [] for name in jobs}
    failed: dict[str, str] = {}
    for _ in range(repeats):
        for name, job in jobs.items():
            if name in failed:
                continue
            start = time.perf_counter()
            try:
                job()
            except (RuntimeError, MemoryError) as error:
                if not is_out_of_memory(error):
                    raise
                failed[name] = f"out of memory ({str(error).splitlines()[0][:120]})"
                continue
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) if s else None for name, s in samples.items()}, failed


def warm_up(sides: tuple[str, ...] = ("ours", "tl")) -> None:
    """Pay one-time costs (lazy imports, LAPACK and thread-pool start-up) on the small shape, for the
    ``sides`` a process times or probes: a probe of ours alone never imports TransformerLens."""
    model = build_model(SHAPES["small"])
    if "ours" in sides:
        ours_composition(model, WEIGHTED, probe_residual(model))
        frobenius_k_alone(model)[0]()
    if "tl" in sides:
        tl_scores(build_tl_model(model), "K")


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes (Linux)."""
    return 1024 * int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water RSS mark (VmHWM) to the current RSS; False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_extra_memory_job(side: str, shape_name: str, threads: int | None) -> dict:
    """Run in a fresh process: build the model (and TL's), warm up, then the peak RSS of the side's
    work (ours: all measures; TL: Q, K, V) minus the RSS just before it."""
    set_threads(threads)
    warm_up((side,))
    model = build_model(SHAPES[shape_name])
    residual = probe_residual(model)
    if side == "ours":
        work = lambda: ours_composition(model, WEIGHTED, residual)
    else:
        tl = build_tl_model(model)
        work = lambda: [tl_scores(tl, mode) for mode in KINDS]
    gc.collect()
    reset = reset_peak_rss()
    before = status_bytes("VmRSS")
    work()
    peak = status_bytes("VmHWM") if reset else 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    extra = max(0, peak - before)  # the kernel's RSS counters lag by a few pages: never below 0
    return {"bytes": extra, "method": "VmHWM" if reset else "ru_maxrss, which includes the build"}


def tl_timing_job(shape_name: str, repeats: int, threads: int | None) -> dict[str, float | None]:
    """Run in a fresh process: TL's float32 seconds per mode (median over ``repeats``)."""
    set_threads(threads)
    warm_up(("tl",))
    tl = build_tl_model(build_model(SHAPES[shape_name]))
    seconds, failed = time_interleaved({f"tl_{m}": (lambda m=m: tl_scores(tl, m)) for m in KINDS}, repeats)
    return {"seconds": seconds, "failed": failed}


def in_subprocess(job: Callable, *args) -> tuple[object | None, str | None]:
    """``job(*args)`` in a fresh spawned process: (its result, None) or (None, why it failed)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        try:
            return pool.submit(job, *args).result(), None
        except BrokenProcessPool:
            return None, "subprocess died (killed for memory?)"
        except (RuntimeError, MemoryError) as error:
            if not is_out_of_memory(error):
                raise
            return None, "out of memory"


def limit_address_space(gigabytes: float) -> None:
    """Cap this process (and every subprocess, which inherits it) at ``gigabytes`` of address space,
    so an allocation too big for the machine raises instead of waking the OOM killer."""
    limit = int(gigabytes * 1e9)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def available_gigabytes() -> float:
    kib = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return 1024 * int(kib.group(1)) / 1e9


# ---------------------------------------------------------------- dense float64 reference


def max_relative_error(ours: Tensor, reference: Tensor) -> float:
    """``max |ours - ref| / |ref|`` (NaN in ours where ref is finite counts as an infinite error)."""
    error = (ours.double() - reference.double()).abs() / reference.double().abs().clamp_min(1e-300)
    return error.nan_to_num(nan=math.inf).max().item()


def scored_mask(shape: Shape) -> Tensor:
    """``[L, H, L, H]``: True where the reader's layer is later than the writer's."""
    layer = torch.arange(shape.n_layers)
    mask = layer[:, None] < layer[None, :]
    return mask[:, None, :, None].expand(shape.n_layers, shape.n_heads, shape.n_layers, shape.n_heads)


def symmetric_roots(covariance: Tensor) -> tuple[Tensor, Tensor]:
    """``(Σ^(1/2), Σ^(-1/2))`` with eigenvalues below ``EIGEN_FLOOR · λ_max`` raised to it: at
    12x12x768 the embedding covariance (257 tokens, 33 positions) has rank <= 288 < d_model."""
    values, vectors = torch.linalg.eigh(covariance)
    values = values.clamp_min(EIGEN_FLOOR * values.max()).sqrt()
    return (vectors * values) @ vectors.T, (vectors / values) @ vectors.T


def covariance(rows: Tensor) -> Tensor:
    """Population covariance ``[d, d]`` of the rows ``[N, d]``."""
    centred = rows - rows.mean(0)
    return centred.T @ centred / rows.shape[0]


def whitening_roots(model64: AttentionOnlyTransformer, residual64: list[Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Σ^(±1/2) for the three whitened measures: Σ of every ``W_E[t] + W_pos[p]`` (all tokens and
    positions), Σ of every layer's input on the probe, pooled, and the token Gram ``W_Eᵀ W_E / d_vocab``
    (uncentred, no positions: token space)."""
    d = model64.shape.d_model
    embedded = (model64.W_E[:, None, :] + model64.W_pos[None, :, :]).reshape(-1, d)
    pooled = torch.cat([x.reshape(-1, d) for x in residual64])
    gram = model64.W_E.T @ model64.W_E / model64.W_E.shape[0]
    return {
        "whitened": symmetric_roots(covariance(embedded)),
        "whitened_resid": symmetric_roots(covariance(pooled)),
        "token_space": symmetric_roots(gram),
    }


@dataclass(frozen=True)
class Dense:
    """A dense ``d_model x d_model`` matrix and its SVD ``u diag(s) vh``, computed once."""

    matrix: Tensor
    u: Tensor
    s: Tensor
    vh: Tensor

    @staticmethod
    def of(matrix: Tensor) -> Dense:
        return Dense(matrix, *torch.linalg.svd(matrix))

    @property
    def T(self) -> Dense:
        return Dense(self.matrix.T, self.vh.T, self.s, self.u.T)


def dense_head(model64: AttentionOnlyTransformer, layer: int, head: int) -> dict[str, Dense]:
    """One head's ``W_OV = W_V W_O`` and ``W_QK = W_Q W_Kᵀ``, dense."""
    a = model64.layers[layer]
    return {"OV": Dense.of(a.W_V[head] @ a.W_O[head]), "QK": Dense.of(a.W_Q[head] @ a.W_K[head].T)}


def dense_frobenius(A: Tensor, B: Tensor) -> float:
    """``‖A B‖_F / (‖A‖_F ‖B‖_F)`` of dense matrices."""
    norm = torch.linalg.matrix_norm
    return (norm(A @ B) / (norm(A) * norm(B))).item()


def dense_measures(A: Dense, B: Dense, d_head: int) -> dict[str, float]:
    """The non-whitened measures of writer ``A`` into reader ``B``, textbook formulas on dense matrices:
    A writes along its right singular vectors (rows of ``vh``), B reads along its left ones."""
    norm = torch.linalg.matrix_norm
    product = norm(A.matrix @ B.matrix)
    reads = torch.linalg.vector_norm(A.vh[:d_head] @ B.matrix, dim=-1)  # ‖v_iᵀ B‖ per rank-1 component of A
    component = reads / norm(B.matrix)
    best = component.argmax()
    return {
        "frobenius": dense_frobenius(A.matrix, B.matrix),
        "sv_bound": (product / (A.s.square() * B.s.square()).sum().sqrt()).item(),
        "subspace": (norm(A.vh[:d_head] @ B.u[:, :d_head]).square() / d_head).item(),
        "component": component[best].item(),
        "component_share": ((A.s[best] * reads[best]).square() / product.square()).item(),
    }


def spot_pairs(shape: Shape) -> list[tuple[int, int, int, int]]:
    """Up to ``SPOT_PAIRS`` random scored pairs ``(l1, h1, l2, h2)`` (seed 0), checked for every kind."""
    pairs = scored_mask(shape).nonzero().tolist()
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(SEED))
    return [tuple(pairs[i]) for i in order[:SPOT_PAIRS].tolist()]


@torch.no_grad()
def spot_check(
    model64: AttentionOnlyTransformer, residual64: list[Tensor], ours64: dict, shape: Shape
) -> dict[str, float]:
    """Max relative error per measure of our float64 scores against the dense reference, over
    ``spot_pairs`` and every kind. Whitening conjugates: ``W_OV -> Σ^½ W_OV Σ^-½``, ``W_QK -> Σ^½ W_QK Σ^½``."""
    roots = whitening_roots(model64, residual64)
    head = functools.cache(lambda layer, h: dense_head(model64, layer, h))  # one pair of SVDs per head
    errors: dict[str, float] = {}
    for l1, h1, l2, h2 in spot_pairs(shape):
        A, reader = head(l1, h1)["OV"], head(l2, h2)
        for kind, B in {"Q": reader["QK"], "K": reader["QK"].T, "V": reader["OV"]}.items():
            reference = dense_measures(A, B, shape.d_head)
            for name, (half, inverse_half) in roots.items():
                B_w = half @ B.matrix @ (inverse_half if kind == "V" else half)
                reference[name] = dense_frobenius(half @ A.matrix @ inverse_half, B_w)
            for m in (m for m in WEIGHTED if m in reference):  # a measure the reference does not know is not checked
                ours = ours64[m][kind][l1, h1, l2, h2].reshape(1)
                error = max_relative_error(ours, torch.tensor([reference[m]], dtype=torch.float64))
                errors[m] = max(errors.get(m, 0.0), error)
    return errors


# ---------------------------------------------------------------- FLOPs


def engine_flops(
    shape: Shape, measures: tuple[str, ...], kinds: tuple[str, ...], conditioned: bool = True
) -> float | None:
    """fp32 GEMM FLOPs of our work from ``metrics.composition.engine.composition_flops``, None if absent.
    Takes either ``(shape, measures, kinds)`` or ``(n_layers, n_heads, d_model, d_head, measures, n_kinds)``."""
    try:
        from metrics.composition.engine import composition_flops
    except ImportError:
        return None
    params = inspect.signature(composition_flops).parameters
    if "n_layers" in params:
        s = shape
        if "well_conditioned" in params:
            return float(
                composition_flops(
                    s.n_layers, s.n_heads, s.d_model, s.d_head, measures, len(kinds), well_conditioned=conditioned
                )
            )
        return float(composition_flops(s.n_layers, s.n_heads, s.d_model, s.d_head, measures, len(kinds)))
    return float(composition_flops(shape.transformer_shape(), measures, kinds))


def gemm_flop_rate(repeats: int = 5) -> float:
    """FLOP/s of this machine's best fp32 ``[8192, 768] x [768, 768]`` GEMM."""
    a, b = torch.randn(8192, 768), torch.randn(768, 768)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * 8192 * 768 * 768 / best


def _seconds(job: Callable[[], object]) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


# ---------------------------------------------------------------- one shape


def time_both_sides(shape: Shape, model, residual, tl, repeats: int, threads: int | None) -> dict:
    """Float32 seconds: ours per measure (Q, K, V), all measures, Frobenius K alone; TL per mode.
    TL runs in-process, interleaved with ours, unless its call needs more than ``IN_PROCESS_TL_BYTES``."""
    k_alone, k_path = frobenius_k_alone(model)
    jobs = {"all": lambda: ours_composition(model, WEIGHTED, residual)}
    jobs |= {m: (lambda m=m: ours_composition(model, (m,), residual)) for m in WEIGHTED}
    jobs["frobenius_K"] = k_alone
    tl_in_process = tl_call_bytes(shape, 4) <= IN_PROCESS_TL_BYTES
    if tl_in_process:
        jobs |= {f"tl_{mode}": (lambda mode=mode: tl_scores(tl, mode)) for mode in KINDS}
    seconds, failed = time_interleaved(jobs, repeats)
    if not tl_in_process:
        result, error = in_subprocess(tl_timing_job, shape.name, repeats, threads)
        seconds |= result["seconds"] if result else {f"tl_{mode}": None for mode in KINDS}
        failed |= result["failed"] if result else {"tl": error}
    ours = {name: seconds[name] for name in ("all", *WEIGHTED, "frobenius_K")}
    tl_times = {mode: seconds[f"tl_{mode}"] for mode in KINDS}
    tl_times["QKV"] = sum(tl_times.values()) if None not in tl_times.values() else None
    speedup = tl_times["K"] / ours["frobenius_K"] if tl_times["K"] and ours["frobenius_K"] else None
    return {
        "ours": ours,
        "tl": tl_times,
        "speedup_frobenius_K": speedup,
        "failed": failed,
        "frobenius_K_path": k_path,
        "tl_where": "in process" if tl_in_process else "own subprocess",
    }


def computed_dtype() -> str:
    """The dtype ``composition_of`` returns for a float32 model: what the timings measure."""
    small = build_model(SHAPES["small"])
    return str(ours_composition(small, ("frobenius",), probe_residual(small))["frobenius"]["K"].dtype).removeprefix(
        "torch."
    )


def agreement(shape: Shape, model) -> dict:
    """Float64: TL's and our logits, our Frobenius against TL's (every scored pair), and every measure
    against the dense reference (spot pairs)."""
    model64 = copy.deepcopy(model).double()
    residual64 = probe_residual(model64)
    tl64 = build_tl_model(model64)
    weights_equal, logit_error = tl_matches(model64, tl64)
    result = {"weights_equal_float64": weights_equal, "logit_error_float64": logit_error}
    try:
        ours64 = ours_composition(model64, WEIGHTED, residual64)
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        return result | {"error": "ours ran out of memory in float64"}
    mask = scored_mask(shape)
    frobenius = {}
    for mode in KINDS:
        reference, method = tl_reference(tl64, shape, mode)
        frobenius[mode] = max_relative_error(ours64["frobenius"][mode][mask], reference[mask])
    result |= {"tl_reference": method, "frobenius_vs_tl": frobenius | {"max": max(frobenius.values())}}
    result["unscored_are_nan"] = all(bool(ours64[m][k][~mask].isnan().all()) for m in WEIGHTED for k in KINDS)
    result["dense_spot_check"] = spot_check(model64, residual64, ours64, shape)
    result["dense_spot_pairs"] = len(spot_pairs(shape))
    return result


def measure_shape(shape: Shape, repeats: int = 3, threads: int | None = None, memory: bool = True) -> dict:
    """Everything the report prints for one shape, as plain numbers (None where not measured)."""
    model = build_model(shape)
    residual = probe_residual(model)
    tl = build_tl_model(model)
    weights_equal, logit_error = tl_matches(model, tl)
    result = {
        "shape": asdict(shape),
        "scored_pairs_per_kind": shape.scored_pairs,
        "tl_api": type(tl).__name__,
        "weights_equal_float32": weights_equal,
        "logit_error_float32": logit_error,
        "ours_dtype": computed_dtype(),
    }
    result |= time_both_sides(shape, model, residual, tl, repeats, threads)
    del tl
    result["memory"] = {side: _memory(side, shape, threads) for side in ("ours", "tl")} if memory else None
    result |= agreement(shape, model)
    result["flops"] = engine_flops(shape, WEIGHTED, KINDS, well_conditioned(model, residual))
    return result


def well_conditioned(model: AttentionOnlyTransformer, residual: list[Tensor]) -> bool:
    """Whether every whitened basis of ``model`` is conditioned well enough for the engine's Gram path
    (``metrics.composition.scores.GRAM_ROUNDING``), as ``composition_of`` decides; True if unknown."""
    try:
        from metrics.composition.scores import GRAM_ROUNDING, basis_whitening
    except ImportError:
        return True
    bases = {WEIGHT_MEASURES[m].basis for m in WEIGHTED} - {"raw"}
    eps = torch.finfo(model.W_E.dtype).eps
    return all(basis_whitening(model, b, residual, None).condition * eps <= GRAM_ROUNDING for b in bases)


def _memory(side: str, shape: Shape, threads: int | None) -> dict:
    measured, error = in_subprocess(peak_extra_memory_job, side, shape.name, threads)
    return measured if measured else {"bytes": None, "method": error}


# ---------------------------------------------------------------- report


def _s(seconds: float | None) -> str:
    return "failed" if seconds is None else f"{seconds:.4f} s" if seconds < 10 else f"{seconds:.1f} s"


def _gb(n: float | None) -> str:
    return "failed" if n is None else f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _e(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.1f}x"


def _ok(passed: bool) -> str:
    return "ok" if passed else "FAILED"


def report_shape(r: dict, gemm_rate: float) -> list[str]:
    """The printed block for one shape."""
    s = Shape(**r["shape"])
    ours, tl = r["ours"], r["tl"]
    lines = [
        f"== {s}: {r['scored_pairs_per_kind']} scored pairs per kind ==",
        f"TL model: {r['tl_api']}; weights equal ours: float32 {r['weights_equal_float32']}, float64 "
        f"{r['weights_equal_float64']}; logits vs ours, max |d|/max|logit|: float32 {_e(r['logit_error_float32'])}, "
        f"float64 {_e(r['logit_error_float64'])}",
        f"ours, float32 model (composition_of returns {r['ours_dtype']}), seconds for Q, K and V together:",
    ]
    lines += [f"  {m:<17}{_s(ours[m])}" for m in WEIGHTED]
    lines += [
        f"  {'all measures':<17}{_s(ours['all'])}",
        f"frobenius K alone, ours: {_s(ours['frobenius_K'])} via {r['frobenius_K_path']}",
        f"TL all_composition_scores, float32 ({r['tl_where']}): K {_s(tl['K'])}, Q+K+V {_s(tl['QKV'])}",
        f"speed-up, our frobenius K over TL's K: {_x(r['speedup_frobenius_K'])}",
    ]
    for name, why in r["failed"].items():
        lines.append(f"  ! {name}: {why}")
    if r["memory"]:
        mem = r["memory"]
        lines.append(
            f"peak extra memory (fresh subprocess, {mem['ours']['method']}): ours, all measures Q+K+V "
            f"{_gb(mem['ours']['bytes'])}; TL, Q+K+V {_gb(mem['tl']['bytes'])}"
        )
    if "error" in r:
        lines.append(f"agreement: n/a, {r['error']}")
    else:
        f = r["frobenius_vs_tl"]
        lines.append(
            f"agreement, float64, our frobenius vs TL ({r['tl_reference']}), max rel. error over all scored "
            f"pairs: Q {_e(f['Q'])}, K {_e(f['K'])}, V {_e(f['V'])}: {_ok(f['max'] <= TOLERANCE)} (<= {TOLERANCE:g})"
        )
        spots = r["dense_spot_check"]
        lines.append(
            f"dense float64 reference, {r['dense_spot_pairs']} random pairs x Q, K, V, max rel. error: "
            + ", ".join(f"{m} {_e(e)}" for m, e in spots.items())
            + f": {_ok(max(spots.values()) <= TOLERANCE)}; unscored pairs NaN: {r['unscored_are_nan']}"
        )
    flops = r["flops"]
    if flops is None:
        lines.append(
            f"fp32 GEMM FLOPs of our work: n/a (no metrics.composition.engine.composition_flops); "
            f"machine GEMM rate {gemm_rate / 1e9:.1f} GFLOP/s"
        )
    else:
        achieved = flops / ours["all"] if ours["all"] else None
        lines.append(
            f"fp32 GEMM FLOPs of our work (all measures, Q+K+V): {flops:.3e}; achieved "
            f"{_e(achieved)} FLOP/s = {'n/a' if achieved is None else f'{achieved / gemm_rate:.1%}'} of this "
            f"machine's GEMM rate {gemm_rate / 1e9:.1f} GFLOP/s"
        )
    return lines


def targets(r: dict) -> list[tuple[str, bool | None]]:
    """The three targets at the large shape: (description, met; None where not measured)."""
    speedup, seconds = r["speedup_frobenius_K"], r["ours"]["all"]
    memory = r["memory"]["ours"]["bytes"] if r["memory"] else None
    return [
        (
            f"frobenius K >= {TARGET_SPEEDUP:g}x faster than TL's K (float32): {_x(speedup)}",
            None if speedup is None else speedup >= TARGET_SPEEDUP,
        ),
        (
            f"all measures, Q+K+V <= {TARGET_SECONDS:g} s: {_s(seconds)}",
            None if seconds is None else seconds <= TARGET_SECONDS,
        ),
        (
            f"our peak extra memory <= {TARGET_BYTES / 1e9:g} GB: {_gb(memory)}",
            None if memory is None else memory <= TARGET_BYTES,
        ),
    ]


def report_header(results: dict) -> str:
    lines = [
        f"torch {results['torch']}, TransformerLens {results['transformer_lens']}, {results['threads']} threads, "
        f"{results['repeats']} repeats, address-space limit {results['mem_limit_gb']:.1f} GB; "
        f"fp32 GEMM [8192,768]x[768,768]: {results['gemm_flop_rate'] / 1e9:.1f} GFLOP/s"
    ]
    load, cores = results["load_average"], results["cpu_count"]
    lines.append(
        f"load average at start {load:.1f} on {cores} CPUs"
        + (": the CPUs are busy, timings are unreliable (--threads 1 suffers least)" if load >= cores else "")
    )
    return "\n".join(lines) + "\n"


def report_targets(results: dict) -> str:
    large = results["shapes"].get(TARGET_SHAPE)
    if large is None:
        return f"targets (at {SHAPES[TARGET_SHAPE]}): not run; pass --shapes {TARGET_SHAPE}"
    lines = [f"targets at {SHAPES[TARGET_SHAPE]}:"]
    lines += [f"  {'n/a' if met is None else 'met' if met else 'NOT met'}: {text}" for text, met in targets(large)]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES), help="which shapes (default: all)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each job; the median is reported")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--mem-limit-gb", type=float, help="address-space limit per process (default: 90%% of MemAvailable)"
    )
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    require_transformer_lens()
    load = os.getloadavg()[0]  # before this process adds to it
    mem_limit = args.mem_limit_gb or 0.9 * available_gigabytes()
    limit_address_space(mem_limit)
    set_threads(args.threads)
    warm_up()
    results = {
        "torch": torch.__version__,
        "transformer_lens": tl_version(),
        "threads": torch.get_num_threads(),
        "load_average": load,
        "cpu_count": os.cpu_count(),
        "mem_limit_gb": mem_limit,
        "repeats": args.repeats,
        "gemm_flop_rate": gemm_flop_rate(),
        "shapes": {},
    }
    print(report_header(results), flush=True)
    for name in [n for n in SHAPES if n in args.shapes]:
        results["shapes"][name] = measure_shape(SHAPES[name], args.repeats, args.threads)
        print("\n".join(report_shape(results["shapes"][name], results["gemm_flop_rate"])) + "\n", flush=True)
    results["load_average_end"] = os.getloadavg()[0]
    print(report_targets(results))
    print(f"load average at the end {results['load_average_end']:.1f} on {results['cpu_count']} CPUs")
    if args.out:
        write_results(args.out, "composition", results)
    return results


if __name__ == "__main__":
    main()
