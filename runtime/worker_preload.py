"""What the ensemble's fork server imports once, before it forks any worker (``runtime/ensemble_job.py``,
``worker_context``): Lightning and the modules every worker runs, so that each worker starts without
importing them again."""

import lightning  # noqa: F401

import callbacks.ensemble_members  # noqa: F401
import models.ensemble_module  # noqa: F401
import runtime.build  # noqa: F401
