"""Lightning, imported without the optional packages torchmetrics pulls in for metrics no run computes.

Lightning imports torchmetrics whenever it loads (for its ``Metric`` type, whatever a run logs), and
torchmetrics imports every optional package of its metrics that it finds installed: SciPy's ``signal``
(audio metrics), ``transformers`` with ``huggingface_hub`` and an HTTP stack (BERTScore) and matplotlib
(its plots). Where every extra is installed, ``import torch, lightning`` took 6.6-7.3 s, and
``import torch`` then :func:`import_lightning` 3.6-3.9 s (the 2-core machine, 2026-11-29; in
``python -X importtime``, self times: SciPy 1.06 s, transformers and what it loads 0.9 s, matplotlib
0.3 s). The core installs SciPy and matplotlib for the project's own use; TransformerLens brings
transformers.

:func:`import_lightning` tells torchmetrics that those three are not installed while Lightning
loads, and nothing else: torchmetrics asks both of its questions (is a package there, which version)
through ``lightning_utilities``, whose two functions are swapped for that time only. Each package is
still imported where this project uses it (the strategies' SciPy, the report's matplotlib,
TransformerLens's transformers); only torchmetrics's own metrics that need them would say they are
missing. ``importlib.metadata`` itself is not touched. Where Lightning is already loaded, or
``lightning_utilities`` no longer asks through those functions, Lightning is imported as it is.

Called before the first import of :mod:`conf.build` (which imports Lightning): by a run
(``runtime.job``), the ensemble's parent and workers, and the analyses that build a tracker or a W&B
logger (``python -m analysis.rescore`` 15.3-17.4 s before, 11.2-11.4 s after, on a 40-step run).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError

UNUSED_BY_TORCHMETRICS = frozenset({"matplotlib", "scipy", "transformers"})
"""The packages torchmetrics is told are absent while Lightning loads."""


def import_lightning() -> None:
    """Import Lightning (``lightning``, with ``lightning.pytorch``) as described in the module's docstring."""
    if "lightning" in sys.modules:
        return
    from lightning_utilities.core import imports as asks

    real_version = getattr(asks, "_version", None)
    real_available = getattr(asks, "package_available", None)
    if real_version is None or real_available is None:  # lightning_utilities changed: import as it is
        import lightning  # noqa: F401

        return
    hiding = True

    def version(name: str) -> str:
        if hiding and name in UNUSED_BY_TORCHMETRICS:
            raise PackageNotFoundError(name)
        return real_version(name)

    def package_available(name: str) -> bool:
        # torchmetrics keeps this function (``from ... import``): after the import it answers truly
        return False if hiding and name in UNUSED_BY_TORCHMETRICS else real_available(name)

    asks._version, asks.package_available = version, package_available
    try:
        import lightning  # noqa: F401
    finally:
        hiding = False
        asks._version, asks.package_available = real_version, real_available
