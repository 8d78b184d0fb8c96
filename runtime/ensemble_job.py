"""Train a group of compatible runs as one ensemble, each member still a whole run.

``fit_ensemble`` is ``train.py``'s ``fit`` and ``runtime.job.run_job`` for many runs at once: each
member's config builds its callbacks, loggers, model and data exactly as a single run's would (in the
same order, from the same seed, so member ``k`` starts where ``python train.py seed=k`` starts);
the members' models are stacked (:class:`models.ensemble_module.EnsembleLM`) and one trainer fits them.
How each member ended (finished; diverged and stopped; preempted with the others; failed) goes into
its ``status.json`` and W&B run, as a single run's does.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from records.layout import CHECKPOINTS, ENSEMBLE_RESUME, LAST_CHECKPOINT, RUN_KEY, TRAIN_LOG
from records.status import FAILED, FINISHED, PREEMPTED, RUNNING, STOP_SIGNALS, write_status
from runtime.console import tee_console
from runtime.job import ExplorerPage, JobEnded, objective_value, signals_handled, startup_signals_noted
from runtime.slurm import requeue_this_job


@dataclass
class MemberJob:
    """One job of the sweep to train as an ensemble member: its config, directory and command-line overrides."""

    cfg: DictConfig
    run_dir: Path
    overrides: list[str]
    job_num: int


def fit_ensemble(jobs: list[MemberJob], sweep_dir: Path, command: str, ensemble_id: str) -> list[float]:
    """Train ``jobs`` (one compatible group) as one ensemble; returns each job's sweep value (its
    objective, or its exit code: 0 finished, 1 failed). A preemption stops the process, as a sweep's
    preempted job does (the same ``command`` again resumes every member)."""
    with ExitStack() as stack:
        for job in jobs:
            stack.enter_context(tee_console(job.run_dir / TRAIN_LOG))
        for job in jobs:
            write_status(job.run_dir, RUNNING)
        try:
            members = train(jobs, sweep_dir, command, ensemble_id)
        except EnsemblePreempted:
            raise
        except Exception as error:  # the members' W&B runs are ended as failed by train()
            traceback.print_exc()
            for job in jobs:
                write_status(job.run_dir, FAILED, 1, error=f"{type(error).__name__}: {error}")
            return [float("nan") if job.cfg.objective else 1 for job in jobs]
        values = []
        for job, member in zip(jobs, members):
            if member.ended is not None:
                JobEnded(1, member.ended, FAILED, member.ended_step).announce(job.run_dir)
                values.append(float("nan") if job.cfg.objective else 1)
            else:
                write_status(job.run_dir, FINISHED)
                values.append(objective_value(job.cfg, job.run_dir) if job.cfg.objective else 0)
        return values


def train(jobs: list[MemberJob], sweep_dir: Path, command: str, ensemble_id: str):
    """Build every member, fit them together; returns the members (``callbacks.ensemble_members.Member``)."""
    import lightning as L  # Lightning and W&B load only once every config is known to be good
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from callbacks.divergence import DivergenceGuard
    from callbacks.ensemble_members import EnsembleMembers, EnsembleStop, Member
    from callbacks.preemption import Preempted, StopOnSignal
    from callbacks.run_record import RunRecord
    from conf.objects import from_config
    from data.datamodule import EnsembleDataModule
    from models.ensemble_module import EnsembleLM
    from models.optimizer import OptimizerSettings
    from records.ensemble_checkpoint import ENSEMBLE_RECORD, join_members, save_atomically
    from records.wandb_run import new_wandb_id
    from runtime.build import (
        build_callbacks,
        build_datamodule,
        build_loggers,
        build_module,
        run_record,
        silence_known_warnings,
        trainer_loop,
    )
    from runtime.continuation import Continuation
    from runtime.naming import wandb_naming
    from runtime.threads import set_torch_threads, torch_threads

    silence_known_warnings()
    first = jobs[0].cfg
    if (threads := torch_threads(first, None)) is not None:
        set_torch_threads(threads)  # else torch's default, or what a worker of fit_parts set
    started = time.perf_counter()
    members, models, datamodules, continuations = [], [], [], []
    single_run_only = (DivergenceGuard, RunRecord, ModelCheckpoint, StopOnSignal)  # done per member by the ensemble
    for index, job in enumerate(jobs):
        cfg = job.cfg
        L.seed_everything(cfg.seed, workers=True, verbose=False)  # as train.py's fit, member by member
        continuation = Continuation.of(cfg, job.run_dir)
        wandb_id = (continuation.wandb_id or new_wandb_id()) if cfg.logger.wandb.enabled else None
        naming = wandb_naming(cfg, job.overrides, str(sweep_dir))
        callbacks = [
            c for c in build_callbacks(cfg, job.run_dir, wandb_id, naming) if not isinstance(c, single_run_only)
        ]
        loggers = build_loggers(cfg, job.run_dir, continuation, wandb_id, naming, several_runs=True)
        models.append(build_module(cfg).model)
        datamodules.append(build_datamodule(cfg))
        record = run_record(cfg, wandb_id)
        record[RUN_KEY][ENSEMBLE_RECORD] = {"size": len(jobs), "index": index, "id": ensemble_id}
        members.append(
            Member(index, job.run_dir, loggers, callbacks, record[RUN_KEY], job.run_dir / CHECKPOINTS / LAST_CHECKPOINT)
        )
        continuations.append(continuation)
    trainer_cfg = first.trainer
    module = EnsembleLM(
        models,
        [from_config(OptimizerSettings, job.cfg.optim) for job in jobs],
        [job.cfg.trainer.gradient_clip_val for job in jobs],
    )
    dispatcher = EnsembleMembers(
        members,
        trainer_cfg.checkpoint_every_n_steps,
        trainer_cfg.progress_every_n_steps if trainer_cfg.enable_progress_bar else None,
    )
    checkpoint = None
    if continuations[0].checkpoint is not None:
        checkpoint = jobs[0].run_dir / ENSEMBLE_RESUME
        states = [torch.load(c.checkpoint, map_location="cpu", weights_only=True) for c in continuations]
        save_atomically(join_members(states, dispatcher.state_key), checkpoint)
        print(f"resuming {len(jobs)} members at step {continuations[0].step}, in place")
    print(
        f"ensemble of {len(jobs)} members (jobs {', '.join(str(j.job_num) for j in jobs)}) set up in"
        f" {time.perf_counter() - started:.1f} s"
    )
    trainer = L.Trainer(  # clipping, loggers and progress are the members' own (callbacks.ensemble_members)
        default_root_dir=str(sweep_dir),
        enable_progress_bar=False,
        logger=False,
        callbacks=[dispatcher, EnsembleStop(dispatcher)],
        **trainer_loop(trainer_cfg),
    )
    fit_started = time.perf_counter()
    try:
        trainer.fit(module, datamodule=EnsembleDataModule(datamodules), ckpt_path=checkpoint, weights_only=True)
    except Preempted as stop:
        preempted(members, jobs, stop, command)
    except BaseException:
        for member in members:
            finish_member_wandb(member, 1)
        raise
    finally:
        if checkpoint is not None:
            checkpoint.unlink(missing_ok=True)
    for member, job in zip(members, jobs):  # each member's page, as a single run writes and logs its own
        finish_member_wandb(member, 0 if member.ended is None else 1, page=job.cfg.explorer and member.ended is None)
    print(cost_line(dispatcher, time.perf_counter() - fit_started))
    return members


def cost_line(dispatcher, seconds: float) -> str:
    """Where the ensemble's time went: training (every member at once) and each member's own callbacks
    (measuring, recording, reporting), by callback, summed over the members."""
    n = len(dispatcher.members)
    by_callback: dict[str, float] = {}
    for member in dispatcher.members:
        for name, spent in member.seconds.items():
            by_callback[name] = by_callback.get(name, 0.0) + spent
    own = sum(by_callback.values())
    parts = ", ".join(f"{name} {spent:.1f}" for name, spent in sorted(by_callback.items(), key=lambda i: -i[1]))
    steps = max(1, dispatcher.trainer.global_step)
    return (
        f"ensemble: {n} members in {seconds:.1f} s: training {dispatcher.training_seconds:.1f} s"
        f" ({1000 * dispatcher.training_seconds / steps:.1f} ms a step for all, "
        f"{1000 * dispatcher.training_seconds / steps / n:.2f} ms a member-step), the members' own callbacks"
        f" {own:.1f} s ({own / n:.1f} s a member{'; ' + parts if parts else ''})"
    )


def finish_member_wandb(member, exit_code: int, preempting: bool = False, page: bool = False) -> None:
    """Write the member's CSV, then (``page``) its ``explorer.html``, logged to its W&B run, which then ends."""
    from lightning.pytorch.loggers import WandbLogger

    wandb_loggers = [logger for logger in member.loggers if isinstance(logger, WandbLogger)]
    for logger in member.loggers:
        if logger not in wandb_loggers:
            logger.finalize("success" if exit_code == 0 else "failed")
    written = ExplorerPage(member.run_dir) if page else None
    for logger in wandb_loggers:
        run = logger.experiment
        if written is not None:
            written.publish(run)
        if preempting:
            run.mark_preempting()
        run.finish(exit_code=exit_code)
    if written is not None:
        written.wait()  # written already where it was logged: said here


class EnsemblePreempted(Exception):
    """Every member of a part was checkpointed and recorded as preempted: stop with ``exit_code``."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"preempted (exit code {exit_code})")
        self.exit_code = exit_code


def preempted(members, jobs: list[MemberJob], stop, command: str) -> None:
    """Every member was checkpointed at ``stop.step``: record it in each, and raise :class:`EnsemblePreempted`
    (:func:`stop_preempted` then requeues under SLURM, once for the whole launch, and stops)."""
    for member, job in zip(members, jobs):
        if member.ended is not None:
            JobEnded(1, member.ended, FAILED, member.ended_step).announce(job.run_dir)
            finish_member_wandb(member, 1)
            continue
        finish_member_wandb(member, stop.exit_code, preempting=True)
        JobEnded(
            stop.exit_code,
            f"stopped by {stop.signum.name} at step {stop.step}; checkpoint: {member.checkpoint};"
            f" continue with: {command}",
            PREEMPTED,
            stop.step,
        ).announce(job.run_dir)
    raise EnsemblePreempted(stop.exit_code)


def stop_preempted(exit_code: int) -> None:
    """A preempted launch: ask SLURM to requeue the job (when under SLURM), then leave with ``exit_code``
    (at once when requeued, as submitit does; else as a stopped sweep, which the same command resumes)."""
    requeued, said = requeue_this_job()
    if said:
        print(said, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if requeued:
        os._exit(exit_code)
    sys.exit(exit_code)


@dataclass
class Part:
    """Jobs trained as one ensemble, in this process or a worker of :func:`fit_parts`."""

    jobs: list[MemberJob]
    ensemble_id: str


def fit_parts(parts: list[Part], sweep_dir: Path, command: str, n_jobs: int) -> list[list[float]]:
    """Train every part, ``n_jobs`` at a time, each in a process of its own with the cores shared among
    them (as ``runtime.threads.torch_threads`` shares them among joblib's jobs); 1: in this process. A part
    starts as soon as one ends (parts of unequal length leave no core idle). A stop signal reaches every
    running part and starts no other; a preempted part stops the launch once every running part has
    stopped. Returns each part's values (:func:`fit_ensemble`)."""
    if n_jobs <= 1:
        values = []
        with startup_signals_noted():
            for part in parts:
                try:
                    values.append(fit_ensemble(part.jobs, sweep_dir, command, part.ensemble_id))
                except EnsemblePreempted as stop:
                    stop_preempted(stop.exit_code)
        return values
    from multiprocessing.connection import wait

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // n_jobs)
    context = worker_context()
    results: list[list[float] | None] = [None] * len(parts)
    waiting = list(range(len(parts)))
    running: dict = {}  # each running part's end of its pipe: (its index, its process)
    live: list = []  # the running processes, which a stop signal reaches
    preempted: list[int] = []  # the exit codes of parts that a stop signal ended
    with forwarded_signals(live) as signalled:
        while running or (waiting and not signalled and not preempted):
            while waiting and not signalled and not preempted and len(running) < n_jobs:
                index = waiting.pop(0)
                receive, send = context.Pipe(duplex=False)
                process = context.Process(
                    target=fit_part,
                    args=(parts[index], sweep_dir, command, threads, send),
                    name=f"ensemble-part-{index}",
                )
                process.start()
                send.close()
                running[receive] = (index, process)
                live.append(process)
            for receive in wait(list(running)):
                index, process = running.pop(receive)
                try:
                    outcome = receive.recv()
                except EOFError:  # the worker died without a word (killed)
                    outcome = ("failed", f"its process ended with exit code {process.exitcode}")
                process.join()
                live.remove(process)
                if outcome[0] == "values":
                    results[index] = outcome[1]
                elif outcome[0] == "preempted":
                    preempted.append(outcome[1])
                else:
                    print(f"ensemble part {index} failed: {outcome[1]}", file=sys.stderr)
                    for job in parts[index].jobs:
                        write_status(job.run_dir, FAILED, 1, error=outcome[1])
                    results[index] = [float("nan") if job.cfg.objective else 1 for job in parts[index].jobs]
    if preempted or (signalled and waiting):  # stopped, or a signal between parts: none started after it
        stop_preempted(preempted[0] if preempted else signalled[0])
    return results


WORKER_PRELOAD = ("runtime.worker_preload",)
"""What the workers' fork server imports once, so that each worker starts without paying for it again."""


def worker_context():
    """Where :func:`fit_parts` starts its workers: forked from a fork server (a fresh interpreter
    started on the first launch, which has imported :data:`WORKER_PRELOAD` and run nothing: no torch
    threads, no W&B), so each worker after the server's first imports starts in 0.04 s and 0.02 s of
    CPU instead of importing torch and Lightning again (7 s; ``python -m bench.worker_start``, 2-core
    machine); ``spawn`` where there is no fork server (Windows). Either way no state of this process
    (torch's threads, W&B's service) is forked."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


def fit_part(part: Part, sweep_dir: Path, command: str, threads: int, send) -> None:
    """A worker of :func:`fit_parts`: train one part on ``threads`` torch threads, and send back
    ``("values", [...])``, ``("preempted", exit_code)`` or ``("failed", why)``."""
    from runtime.threads import set_torch_threads

    with startup_signals_noted():  # first: the launcher forwards a stop signal however early it comes
        os.setpgrp()  # out of the terminal's process group: a Ctrl-C reaches it once, forwarded by the launcher
        for stream in (sys.stdout, sys.stderr):  # whole lines: the parts share the console (and a redirected log)
            stream.reconfigure(line_buffering=True)
        if part.jobs[0].cfg.trainer.num_threads is None:
            set_torch_threads(threads)
        try:
            send.send(("values", fit_ensemble(part.jobs, sweep_dir, command, part.ensemble_id)))
        except EnsemblePreempted as stop:
            send.send(("preempted", stop.exit_code))
        except BaseException as error:  # noqa: BLE001 - whatever it was, the launcher must hear of it
            send.send(("failed", f"{type(error).__name__}: {error}"))
        finally:
            send.close()


@contextmanager
def forwarded_signals(processes: list) -> Iterator[list[int]]:
    """While the workers run, a stop signal to this process (SLURM's, a user's Ctrl-C) is passed on to
    each of ``processes`` (a list the caller keeps current), which checkpoints its members and stops
    (``callbacks.ensemble_members.EnsembleStop``). Yields a list that holds ``128 + signum`` once one came."""
    signalled: list[int] = []

    def forward(signum: int, frame) -> None:
        signalled.append(128 + signum)
        for process in list(processes):
            if process.is_alive():
                os.kill(process.pid, signum)

    with signals_handled(STOP_SIGNALS, forward):
        yield signalled


def sweep_command(config: DictConfig, sweep_dir: Path) -> str:
    """The command that launches this sweep again into ``sweep_dir`` (and so resumes it)."""
    task = list(config.hydra.overrides.task)
    hydra = [o for o in config.hydra.overrides.hydra if not o.startswith(("hydra.sweep.dir=", "hydra.mode="))]
    return " ".join(
        ["python train.py -m", *map(shlex.quote, task + hydra), f"hydra.sweep.dir={shlex.quote(str(sweep_dir))}"]
    )
