"""Reproducible benchmarks, one command each (``python -m bench.NAME --help``).

Importing the package first makes idle OpenMP threads sleep instead of spin, as ``train.py`` does:
on a shared machine spinning threads slow batched linear algebra down 100-fold (docs/operations.md, "Threads").
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
