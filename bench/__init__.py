"""Reproducible benchmarks, one command each (``python -m bench.NAME --help``).

Importing the package first sets how torch's idle OpenMP threads wait, as ``train.py`` does
(:func:`runtime.threads.bounded_spinning`).
"""

import os

from runtime.threads import bounded_spinning

os.environ.update(bounded_spinning(os.environ))
