"""Thin orchestration: when to measure and where to log. The math lives in ``metrics/``."""
