"""A run as a job: its status file, what each way of ending means (exit code, W&B state, SLURM
requeue), a sweep job's skip-or-resume, and the value an optimizing sweeper reads.

A single run that fails exits non-zero; a sweep's job returns its exit code instead, so that the
other jobs still run (the sweep's report marks it, and exits non-zero). A preempted job (SIGUSR1,
SIGTERM) records how to continue, asks SLURM to requeue it when it runs under SLURM, and stops the
sweep: the same command again resumes it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from conf.validate import ConfigError, validate
from records.disk import ReportUnwritten, disk_full, exception_chain, make_room, what_failed
from records.layout import CHECKPOINTS, LAST_CHECKPOINT, SUMMARY_NAME, TRAIN_LOG
from records.status import FAILED, FINISHED, PREEMPTED, RUNNING, STOP_SIGNALS, read_status, write_status
from runtime.console import tee_console
from runtime.slurm import remember_slurm_run, requeue_this_job


class JobEnded(Exception):
    """A run that ended without finishing: ``exit_code`` and a one-line ``message`` for the console."""

    def __init__(self, exit_code: int, message: str, status: str = FAILED, step: int | None = None) -> None:
        super().__init__(message)
        self.exit_code, self.status, self.step = exit_code, status, step
        self.announced = False

    def announce(self, run_dir: Path) -> None:
        """Record the ending in ``status.json`` and print it, once."""
        if not self.announced:
            write_status(run_dir, self.status, self.exit_code, self.step, str(self))
            print(self, file=sys.stderr)
            self.announced = True


def run_job(cfg: DictConfig, train: Callable[[DictConfig, Path], None]) -> float:
    """Run ``train(cfg, run_dir)`` in Hydra's output directory as a job; returns the sweep's value
    (the objective, or the job's exit code) and exits non-zero when a single run fails."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    trained = False
    with (
        tee_console(run_dir / TRAIN_LOG),
        time_limit_warnings_noted(),
    ):  # the report, warnings and errors, also in the run directory
        try:
            if multirun and not prepare_sweep_job(cfg, run_dir):  # finished by an earlier launch of the same sweep
                return objective_value(cfg, run_dir) if cfg.objective else 0
            if not multirun:
                remember_slurm_run(run_dir)  # a sweep's job finds its directory again by its number
            with startup_signals_noted():  # before status.json says running: a signal from then on is kept
                write_status(run_dir, RUNNING)
                train(cfg, run_dir)
            trained = True
            write_status(run_dir, FINISHED)
        except JobEnded as ended:
            ended.announce(run_dir)
            if not multirun or ended.status == PREEMPTED:
                sys.exit(ended.exit_code)  # a stopped sweep stops: the same command again resumes it
            return float("nan") if cfg.objective else ended.exit_code  # NaN: a failed trial, to Optuna
        except Exception as error:
            if (full := disk_full(error)) is not None:  # one line, the status, and how to finish: no traceback
                ended = JobEnded(1, no_room_line(run_dir, full, error, trained))
                make_room(run_dir, full)
                try:
                    ended.announce(run_dir)
                except OSError:  # no room even for the status: said all the same
                    print(f"{ended} (status.json could not be written either)", file=sys.stderr)
                if not multirun:
                    sys.exit(1)
                return float("nan") if cfg.objective else 1
            write_status(run_dir, FAILED, 1, error=f"{type(error).__name__}: {error}")
            if not multirun:
                raise
            traceback.print_exc()
            return float("nan") if cfg.objective else 1
        except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, without a checkpoint
            write_status(run_dir, FAILED, 128 + signal.SIGINT, error="stopped by a second Ctrl-C, without a checkpoint")
            raise
        return objective_value(cfg, run_dir) if cfg.objective else 0


def no_room_line(run_dir: Path, full: OSError, error: BaseException, trained: bool = False) -> str:
    """The one line a full disk gets: what could not be written, what is kept, and the command that
    finishes the run once there is room (the report, where training had finished; else the resume)."""
    what = what_failed(full, run_dir)
    if trained:  # the run's files are all written: only its status (or W&B's copy of them) failed
        return f"error: no space left on device writing {what}: the run finished and its files are kept"
    if any(isinstance(e, ReportUnwritten) for e in exception_chain(error)):
        return (
            f"error: no space left on device writing {what}: training finished and its records are kept;"
            f" once there is room, write the report with: python -m reports.run_report {run_dir}"
            f" (and the page with: python -m analysis.explorer {run_dir})"
        )
    last = run_dir / CHECKPOINTS / LAST_CHECKPOINT
    kept = f"the last checkpoint ({last}) and" if last.is_file() else "no checkpoint yet, but"
    return (
        f"error: no space left on device writing {what}; {kept} the files written before are kept;"
        f" once there is room, continue with: {resume_command(run_dir)}"
    )


TIME_LIMIT_WARNINGS = (signal.SIGUSR1, signal.SIGUSR2)  # SLURM's (sbatch --signal=USR1@90), submitit's


@contextmanager
def time_limit_warnings_noted() -> Iterator[None]:
    """Outside a run (before a sweep's job is prepared, or while it writes its last files), a warning
    that the time limit is near is noted and the job goes on: by default the signal would end the
    process before it records how it ended. While the run starts, :class:`StartupSignals` keeps it
    (the run stops after its first step); while it trains, ``callbacks.preemption.StopOnSignal``
    takes it over (checkpoint, requeue, stop)."""

    def note(signum: int, frame) -> None:  # the descriptor, not print(): a signal may land inside a write
        os.write(
            sys.__stderr__.fileno(), f"{signal.Signals(signum).name} received outside training: going on\n".encode()
        )

    with signals_handled(TIME_LIMIT_WARNINGS, note):
        yield


@contextmanager
def signals_handled(signums, handler: Callable[[int, object], None]) -> Iterator[None]:
    """``handler`` for each of ``signums`` while the block runs; the handlers from before come back
    after. Off the main thread, where signals never arrive, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, earlier in previous.items():
            signal.signal(signum, earlier)


class StartupSignals:
    """The handler of a stop signal (:data:`records.status.STOP_SIGNALS`) that comes while a run starts
    (imports, set-up, restoring a checkpoint), before :class:`callbacks.preemption.StopOnSignal` takes
    the signals over: the signal is kept in ``noted`` rather than died of, and ``StopOnSignal``, finding
    this handler in place as training starts, stops after the first step with a checkpoint. A second
    Ctrl-C stops at once. Here, not in callbacks/, because it must be in place before Lightning loads."""

    def __init__(self) -> None:
        self.noted: list[signal.Signals] = []

    def __call__(self, signum: int, frame) -> None:
        if self.noted and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.noted.append(signal.Signals(signum))
        os.write(  # the descriptor, not print(): a signal may land inside a write
            sys.__stderr__.fileno(),
            f"{signal.Signals(signum).name} received while starting: stopping after the first step, with a"
            f" checkpoint (Ctrl-C again to stop at once, without one)\n".encode(),
        )


@contextmanager
def startup_signals_noted() -> Iterator[None]:
    """While a run (or an ensemble's runs) starts and trains, a stop signal is never died of: a
    :class:`StartupSignals` has it until training starts, ``StopOnSignal`` while training; the handlers
    from before come back after."""
    with signals_handled(STOP_SIGNALS, StartupSignals()):
        yield


@contextmanager
def training_outcome(run_dir: Path, explorer: bool = False) -> Iterator[ExplorerPage | None]:
    """Around ``trainer.fit``: a preemption, a divergence or any other failure ends the W&B run as
    preempted or failed (never successful) and becomes a :class:`JobEnded` with the command that
    continues; a preempted SLURM job is requeued and leaves at once, as submitit does. Yields the run's
    ``explorer.html`` (``explorer``, else None), not yet begun: the end-of-run report begins it while
    its figures are drawn (:meth:`ExplorerPage.start`); a run that finished without a report begins it
    here, while W&B finishes. Either way it is waited for, and said, after W&B has finished."""
    from callbacks.divergence import TrainingDiverged
    from callbacks.preemption import Preempted

    page = ExplorerPage(run_dir) if explorer else None
    try:
        try:
            yield page
        except BaseException:
            if page is not None:
                page.settle()  # begun by a report that then failed: written whole, not cut off at exit
            raise
    except Preempted as stop:
        if page is not None:
            page.publish()  # the page of the run so far, beside its checkpoint, in W&B too
            page.say()
        finish_wandb(stop.exit_code, preempting=True)
        ended = JobEnded(
            stop.exit_code,
            f"stopped by {stop.signum.name} at step {stop.step}; checkpoint: {stop.checkpoint};"
            f" continue with: {resume_command(run_dir)}",
            PREEMPTED,
            stop.step,
        )
        ended.announce(run_dir)
        requeued, said = requeue_this_job()
        if said:
            print(said, file=sys.stderr)
        if requeued:  # no result for this attempt: the requeued one gives it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(stop.exit_code)
        raise ended from None
    except TrainingDiverged as error:
        finish_wandb(1)
        last = run_dir / CHECKPOINTS / LAST_CHECKPOINT
        kept = f"the last finite checkpoint is {last}" if last.is_file() else "no checkpoint was written before it"
        raise JobEnded(1, f"error: {error}; {kept}") from None
    except BaseException:
        finish_wandb(1)  # any other failure (a second Ctrl-C too)
        raise
    if page is not None:
        page.publish()  # begun by the report, or now; logged to the W&B run before it ends
    finish_wandb(0)
    if page is not None:
        page.say()


class ExplorerPage:
    """The run's ``explorer.html`` (:mod:`analysis.explorer_pages`), written on a thread from :meth:`start` on
    (once the run's records are flushed: the CSV log, the tensor store, the trajectory), beside the
    report's figures and W&B's finishing. A page that cannot be written is said on stderr, with the
    command that tries again; the run's numbers, report and status are written already, and stand."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.said, self.failed = run_dir, "", False
        self.path: Path | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin writing the page on its thread (once: later calls do nothing)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self.write, name="explorer page", daemon=True)
            self.thread.start()

    def write(self) -> None:
        from analysis.explorer_pages import write_run_page

        try:
            path, size, seconds = write_run_page(self.run_dir)
            self.path = path
            self.said = f"explorer: {path} ({size / 1e6:.1f} MB, {seconds:.1f} s): open it in a browser, offline"
        except Exception as error:  # the page only: the run itself finished
            self.failed = True
            self.said = (
                f"explorer: not written ({type(error).__name__}: {error}); python -m analysis.explorer {self.run_dir}"
                " tries again"
            )

    def publish(self, run=None) -> None:
        """Write the page (begun now, if it was not) and log it to the run's W&B run as HTML media
        (``run``, or the process's: :func:`records.wandb_run.log_page`; a page W&B cannot take is said, the
        file stands)."""
        from records.wandb_run import WandbOpening, log_page

        self.start()
        self.thread.join()
        if self.failed:
            return
        WandbOpening.settle()
        try:
            log_page(self.path, run)
        except Exception as error:  # W&B's copy only: the page is written
            if (full := disk_full(error)) is not None:
                if full.filename2:
                    Path(full.filename2).unlink(missing_ok=True)  # W&B's copy, cut short
                self.said += "; not logged to W&B: no space left on device for its copy"
            else:
                self.said += f"; not logged to W&B ({type(error).__name__}: {error})"

    def say(self) -> None:
        """Say where the page is, or why it is not."""
        print(self.said, file=sys.stderr if self.failed else sys.stdout, flush=True)

    def wait(self) -> None:
        """Write the page (begun now, if it was not) and say where it is, or why it is not."""
        self.start()
        self.thread.join()
        self.say()

    def settle(self) -> None:
        """Let a page already begun finish (unsaid): a run that fails after its report began the page."""
        if self.thread is not None:
            self.thread.join()


def finish_wandb(exit_code: int, preempting: bool = False) -> None:
    """End the run's W&B run with ``exit_code`` (marked preempting first, if so); nothing to end
    where W&B was never loaded (``logger.wandb.enabled=false``). A W&B run still opening is waited for first."""
    from records.wandb_run import WandbOpening

    WandbOpening.settle()
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return
    if preempting and wandb.run is not None:
        wandb.run.mark_preempting()
    wandb.finish(exit_code=exit_code)


def resume_command(run_dir: Path) -> str:
    """The command that continues this run in place: this run's overrides, with ``resume=RUN_DIR``."""
    overrides = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") != "resume"]
    return " ".join(["python train.py", *overrides, f"resume={run_dir}"])


def objective_value(cfg: DictConfig, run_dir: Path) -> float:
    """What an optimizing sweeper (``hydra/sweeper=optuna``) minimizes or maximizes: ``cfg.objective``,
    a key of the run's ``summary.json`` (``final/loss/repeated``) or of its config (``model.d_model``).
    NaN (a failed trial, to Optuna) when the key is missing, or when ``objective_cliff_by`` is set and
    the repeated-token loss shows no cliff by that step."""
    summary_path = run_dir / SUMMARY_NAME
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if cfg.objective_cliff_by is not None:
        midpoint = summary.get("phase_change/loss_midpoint_step")
        if midpoint is None or midpoint > cfg.objective_cliff_by:
            print(f"objective: NaN (no loss cliff by step {cfg.objective_cliff_by}; midpoint {midpoint})")
            return float("nan")
    value = summary.get(cfg.objective, OmegaConf.select(cfg, cfg.objective))
    print(f"objective {cfg.objective} = {value}")
    return float("nan") if value is None else float(value)


def prepare_sweep_job(cfg: DictConfig, run_dir: Path) -> bool:
    """Validate a sweep job (a single run was validated before Hydra wrote anything); when an earlier
    launch of the same sweep left this job's directory, resume it in place, or skip it if it finished.
    Returns whether the job is to run."""
    earlier = read_status(run_dir)
    if earlier is not None and earlier["status"] == FINISHED and cfg.resume is None:
        print(f"job {HydraConfig.get().job.num} finished in an earlier launch of this sweep: skipped ({run_dir})")
        return False
    if earlier is not None and cfg.resume is None and (run_dir / CHECKPOINTS / LAST_CHECKPOINT).is_file():
        with open_dict(cfg):
            cfg.resume = str(run_dir)  # interrupted: continue from its last checkpoint
    try:
        validate(cfg, multirun=True)
    except ConfigError as error:
        raise JobEnded(1, f"config error: {error}") from None
    return True
