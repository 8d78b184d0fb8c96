"""What W&B would import for features no run here uses, answered without the import. Both are called
before any W&B run opens in a process: by ``conf.wandb_run.WandbOpening`` (a training run's, opened on
a thread before Lightning loads), by ``records.wandb_log.SectionedWandbLogger`` (the analyses', an
ensemble's members') and by the sweep report (``runtime.sweep_callback``). Lightning-free, so that
W&B's opening thread, and a sweep's launching process, import no Lightning."""

from __future__ import annotations

import sys

LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"
"""Where W&B Launch keeps the job inputs a script stages before ``wandb.init``."""


def answer_dataframe_checks_by_type_name() -> None:
    """Before W&B logs a value that is not a plain number (an image, a table), it asks whether it is a
    ``pandas.DataFrame``; where pandas is installed it imports pandas (and pyarrow) to ask, 0.7-1 s
    of a tracked run that logs no DataFrame. ``wandb.util.pd_available`` False makes W&B answer
    from the value's type name instead (``wandb.util.is_pandas_data_frame``), which tells a
    DataFrame as well."""
    import wandb.util

    wandb.util.pd_available = False


def apply_launch_inputs_only_where_staged() -> None:
    """At every ``wandb.init``, W&B applies the job inputs a script staged for W&B Launch
    (``Run._detect_and_apply_job_inputs``), importing :data:`LAUNCH_INPUTS` to look: with it W&B's
    Launch agent and public API, 0.75 s of CPU at every run's start (``python -X importtime``), while
    the project stages none. An input can only have been staged through that module, so where it has
    not been imported there is nothing to apply and the look is skipped; where it has, W&B's own
    method runs. Where W&B no longer has the method, nothing is changed."""
    from wandb.sdk import wandb_run

    detect = getattr(wandb_run.Run, "_detect_and_apply_job_inputs", None)
    if detect is None or getattr(detect, "only_where_staged", False):
        return

    def detect_where_staged(run) -> None:
        if LAUNCH_INPUTS in sys.modules:
            detect(run)

    detect_where_staged.only_where_staged = True
    wandb_run.Run._detect_and_apply_job_inputs = detect_where_staged


def lean_wandb() -> None:
    """Both of the above."""
    answer_dataframe_checks_by_type_name()
    apply_launch_inputs_only_where_staged()
