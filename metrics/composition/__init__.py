"""Composition between heads: per-head circuits, the all-pairs engine, the measures, their random
baselines, the whitened bases, and the axioms the measures are checked against."""
