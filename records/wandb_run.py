"""The one way to a W&B run: its ``wandb.init`` options from a config, and the run itself opened, here
and nowhere else. A training run opens its W&B run on a thread of its own while the process goes on
importing Lightning and building the run (``wandb.init`` takes ~1.5 s, most of it waiting on W&B's
service process: off the start's critical path, see :class:`WandbOpening`); an analysis, an ensemble's
member or a sweep report opens its own with :func:`open_run`. Lightning-free: a sweep's launching process
reports to W&B without importing Lightning. The loggers that log to these runs are
:mod:`records.wandb_log`'s."""

from __future__ import annotations

import os
import secrets
import string
import threading
from collections.abc import Mapping

from omegaconf import DictConfig, OmegaConf

from records.wandb_reach import effective_mode


def wandb_mode(cfg: DictConfig) -> str:
    """The config's mode if set, else ``$WANDB_MODE``, else offline (no account or network needed)."""
    mode = cfg.logger.wandb.mode
    return mode.value if mode is not None else os.environ.get("WANDB_MODE", "offline")


def new_wandb_id() -> str:
    """A fresh W&B run id, chosen here so that checkpoints can record it before W&B starts; under a
    W&B sweep agent, the run id the agent assigned (``$WANDB_RUN_ID``)."""
    if os.environ.get("WANDB_SWEEP_ID") and os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def report_run_options(cfg: DictConfig, save_dir: str | os.PathLike, **run) -> dict:
    """The ``wandb.init`` arguments of an analysis's or a sweep report's W&B run in ``save_dir``: the
    config's project and entity, its mode (online only if the server answers, else offline with one
    warning line: ``records/wandb_reach.py``), and the W&B run's own arguments in ``run`` (name, group,
    job_type, ...)."""
    w = cfg.logger.wandb
    mode = effective_mode(wandb_mode(cfg), w.connect_timeout_s, save_dir)
    return dict(project=w.project, entity=w.entity, dir=str(save_dir), mode=mode, **run)


def wandb_init_options(
    cfg: DictConfig,
    save_dir: str | os.PathLike,
    wandb_id: str | None,
    continues_in_place: bool = False,
    naming=None,
    several_runs: bool = False,
) -> dict:
    """The ``wandb.init`` arguments of a training run's W&B run in ``save_dir`` (a new one, or the one it
    continues in place): the config's project and entity, its mode (online only if the server
    answers, else offline with one warning line: ``records/wandb_reach.py``), its naming (``group``,
    ``name``, ``tags``: ``runtime.naming.WandbNaming``) and config. ``several_runs``: this process holds
    other runs' W&B runs at the same time (an ensemble's members)."""
    w = cfg.logger.wandb
    return dict(
        project=w.project,
        entity=w.entity,
        dir=str(save_dir),
        mode=effective_mode(wandb_mode(cfg), w.connect_timeout_s, save_dir),
        group=getattr(naming, "group", None),
        tags=list(getattr(naming, "tags", ()) or w.tags),
        name=getattr(naming, "name", None) or w.name,
        id=wandb_id,
        resume="allow" if continues_in_place else None,
        config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        **({"reinit": "create_new"} if several_runs else {}),
    )


def open_run(options: Mapping[str, object]):
    """``wandb.init(**options)``: the project's one call that opens a W&B run."""
    import wandb

    return wandb.init(**options)


class WandbOpening:
    """``wandb.init(**options)`` on a daemon thread, started at once: :meth:`run` waits for the W&B run
    and returns it, or raises what ``wandb.init`` raised. A run opens its W&B run so before it imports
    Lightning (seconds of CPU, while ``wandb.init`` mostly waits on W&B's service process), and its
    logger takes the run from here (``records.wandb_log.SectionedWandbLogger``). Until the run is open no
    other thread may import W&B: its modules import each other, and a second thread importing them at the
    same time can be handed one half-initialised (``ImportError: ... partially initialized module``)."""

    latest: WandbOpening | None = None  # the last one started in this process

    def __init__(self, options: dict) -> None:
        self.options = options
        self._run = self._error = None
        self._thread = threading.Thread(target=self._open, name="wandb-init", daemon=True)
        self._thread.start()
        WandbOpening.latest = self

    @classmethod
    def settle(cls) -> None:
        """Wait for the last W&B run still opening (what became of it aside): a run that fails while W&B
        opens ends the W&B run it opened, not one still half open."""
        if cls.latest is not None:
            cls.latest._thread.join()
            cls.latest = None

    def _open(self) -> None:
        try:
            self._run = open_run(self.options)
        except BaseException as error:  # handed to the thread that waits for the run
            self._error = error

    def run(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._run


PAGE_KEY = "explorer"
"""The W&B key of a run's (or a sweep's) ``explorer.html``, logged as HTML media: a W&B section of its own,
placed first in the workspace's story section (:mod:`reports.wandb_workspace`)."""


def log_page(path: str | os.PathLike, run=None) -> bool:
    """``explorer.html`` at ``path`` logged to ``run`` (the process's open W&B run when None) as HTML media
    (``wandb.Html``, the file as it is: W&B's injected stylesheet link would be a network request the page's
    policy refuses). Offline, the page is copied into the run's ``files/media/html/``, and ``wandb sync``
    uploads it. False where there is no W&B run (W&B off, or never loaded)."""
    import sys

    wandb = sys.modules.get("wandb")
    run = run if run is not None else (wandb.run if wandb is not None else None)
    if run is None:
        return False
    run.log({PAGE_KEY: wandb.Html(str(path), inject=False)})
    return True


def log_row(run, values: Mapping[str, object]) -> None:
    """One row of ``values`` (tables, images, charts) logged to a W&B run that has no step axis of its own
    (a sweep report's)."""
    run.log(dict(values))


def open_wandb_run(cfg: DictConfig, run_dir: str | os.PathLike, continuation, naming) -> WandbOpening | None:
    """A single run's W&B run, opening from now on on a thread of its own: the one it continues in place
    (``continuation``: ``runtime.continuation.Continuation``), or a new id; None with
    ``logger.wandb.enabled=false``."""
    if not cfg.logger.wandb.enabled:
        return None
    wandb_id = continuation.wandb_id or new_wandb_id()
    return WandbOpening(wandb_init_options(cfg, run_dir, wandb_id, continuation.in_place, naming))
