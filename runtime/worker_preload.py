"""What the ensemble's fork server imports once, before it forks any worker (``runtime/ensemble.py``,
``worker_context``): Lightning as a run imports it (:mod:`conf.lightning_import`), then the modules
every worker runs, so that each worker starts without importing them again."""

from conf.lightning_import import import_lightning

import_lightning()

import callbacks.ensemble  # noqa: E402, F401
import conf.build  # noqa: E402, F401
import models.ensemble_module  # noqa: E402, F401
