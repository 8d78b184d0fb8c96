"""Causal ground truth (the K-only path ablation and its first-order estimate) and how well a measure agrees with it."""
