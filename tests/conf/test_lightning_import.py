"""Lightning imported as a run imports it (``conf/lightning_import.py``): torchmetrics loads none of
the optional packages it would import for its own metrics, Lightning works, and every answer about
those packages is true again afterwards. In a fresh interpreter: this one has imported Lightning already."""

import json
import subprocess
import sys

from tests.helpers import REPO

FRESH_PROCESS = """
import json, sys
from importlib.util import find_spec
installed = sorted(n for n in ("matplotlib", "scipy", "transformers") if find_spec(n) is not None)
import runtime.worker_preload  # as the ensemble's fork server: import_lightning(), then what a worker runs
loaded = sorted(n for n in ("scipy", "scipy.signal", "transformers", "huggingface_hub") if n in sys.modules)
import importlib.metadata, lightning, torchmetrics
from lightning.pytorch.core.module import Metric
from lightning_utilities.core import imports
from conf.lightning_import import import_lightning
import_lightning()  # Lightning already loaded: nothing to do
print(json.dumps({
    "installed": installed,
    "loaded": loaded,
    "trainer": lightning.Trainer.__module__,
    "metric_is_torchmetrics": Metric is torchmetrics.Metric,
    "available": [imports.package_available(n) for n in installed],
    "required": [bool(imports.RequirementCache(n + ">=0.1")) for n in installed],
    "versions": [bool(importlib.metadata.version(n)) for n in installed],
    "lightning_utilities_restored": imports._version is importlib.metadata.version,
}))
"""


def test_a_runs_lightning_import_loads_no_scipy_or_transformers_and_every_answer_is_true_after():
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    # the test environment has every extra: each package is there to be left out (else this test shows nothing)
    assert seen["installed"] == ["matplotlib", "scipy", "transformers"]
    assert seen["loaded"] == []  # imported by plain `import lightning` in the same environment (torchmetrics)
    assert seen["trainer"].startswith("lightning.pytorch") and seen["metric_is_torchmetrics"]
    assert seen["available"] == seen["required"] == seen["versions"] == [True, True, True]
    assert seen["lightning_utilities_restored"]


def test_plain_lightning_import_does_load_them_here():
    """The reference: without :func:`import_lightning`, this environment's Lightning imports both."""
    code = "import sys, lightning; print(sorted(n for n in ('scipy.signal', 'transformers') if n in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "['scipy.signal', 'transformers']"
