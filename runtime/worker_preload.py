"""What the ensemble's fork server imports once, before it forks any worker (``runtime/ensemble.py``,
``worker_context``): Lightning and the modules every worker runs, so that each worker starts without
importing them again."""

import lightning  # noqa: F401

import callbacks.ensemble  # noqa: F401
import models.ensemble_module  # noqa: F401
import runtime.build  # noqa: F401
