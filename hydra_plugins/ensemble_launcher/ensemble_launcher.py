"""``hydra/launcher=ensemble``: a sweep's jobs trained together as one batched ensemble per shape.

    python train.py -m seed=0,1,2,3,4,5,6,7 hydra/launcher=ensemble

Every job is still a whole run in its own directory of the sweep (``runtime.ensemble_job``). Before
anything is written, every job's config is validated and the jobs are grouped by what must be shared
(``runtime.ensemble_plan``); a bad job is one line of error and exit 1. Like the other launchers, a
job that finished in an earlier launch of the same sweep is skipped and an interrupted one resumes,
so the same command again continues a stopped ensemble.

In ``hydra_plugins``: Hydra instantiates launchers from that package only. A requeued SLURM job
finds its sweep directory again through ``runtime.run_guard`` (before Hydra writes into a new one).
"""

import logging
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class EnsembleLauncherConf:
    _target_: str = "hydra_plugins.ensemble_launcher.ensemble_launcher.EnsembleLauncher"
    # ensembles trained at once, each in a process of its own with the cores shared among them: a
    # group of jobs is split into this many ensembles (1: one ensemble per group, in this process)
    n_jobs: int = 1
    # config keys whose values also split the jobs into ensembles (e.g. [data.block]): members that stop at
    # different times (tracker.stop_after_phase_change) apart, as a stopped member's share is still computed
    split_by: list[str] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/launcher", name="ensemble", node=EnsembleLauncherConf, provider="ensemble")


class EnsembleLauncher(Launcher):
    def __init__(self, n_jobs: int = 1, split_by: Sequence[str] = ()) -> None:
        self.n_jobs = n_jobs
        self.split_by = tuple(split_by)
        self.config: DictConfig | None = None
        self.hydra_context = None
        self.task_function = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from conf.validate import ConfigError, validate
        from records.layout import CHECKPOINTS, LAST_CHECKPOINT, resume_checkpoint
        from records.status import FINISHED, read_status
        from runtime.ensemble_job import MemberJob, Part, fit_parts, sweep_command
        from runtime.ensemble_plan import EnsembleError, compatibility, groups, resume_step, split_line
        from runtime.run_guard import task_config
        from runtime.slurm import remember_slurm_sweep

        setup_globals()
        config = self.config
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
        if not job_overrides:
            sys.exit("error: the ensemble has no members (the sweep gave no jobs)")
        if self.n_jobs < 1:
            sys.exit(f"error: hydra.launcher.n_jobs={self.n_jobs} must be >= 1")
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()

        # 1. every job's config, validated, and whether it is done, to resume, or new: nothing written yet
        configs, keys, finished, problems = {}, {}, set(), []
        for offset, overrides in enumerate(job_overrides):
            num = initial_job_idx + offset
            sweep_config = self.hydra_context.config_loader.load_sweep_config(config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = num
                sweep_config.hydra.job.num = num
            HydraConfig.instance().set_config(sweep_config)
            run_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
            cfg = task_config(sweep_config)
            earlier = read_status(run_dir)
            if earlier is not None and earlier["status"] == FINISHED and cfg.resume is None:
                finished.add(num)
            elif earlier is not None and cfg.resume is None and (run_dir / CHECKPOINTS / LAST_CHECKPOINT).is_file():
                with open_dict(sweep_config):
                    sweep_config.resume = str(run_dir)  # interrupted: continue from its last checkpoint
                cfg = task_config(sweep_config)
            configs[num] = (sweep_config, overrides)
            if num in finished:
                continue
            try:
                resumed = cfg.resume is not None and resume_checkpoint(cfg.resume).is_file()
                step = resume_step(cfg) if resumed else None  # a single run's checkpoint: said first
                validate(cfg, multirun=True, ensemble=True)
                keys[num] = compatibility(cfg, step, self.split_by)
            except (ConfigError, EnsembleError) as error:
                problems.append(f"job {num} ({' '.join(filter_overrides(overrides))}): {error}")
        if problems:
            more = f" (and {len(problems) - 1} more jobs)" if len(problems) > 1 else ""
            sys.exit(f"config error: {problems[0]}{more}; nothing was trained")
        found = groups(keys)
        if len(found) > 1:
            print(split_line(found))
        for num in sorted(finished):
            print(f"job {num} finished in an earlier launch of this sweep: skipped")

        # 2. each job's directory and Hydra files, as the basic launcher writes them
        sweep_dir.mkdir(parents=True, exist_ok=True)
        remember_slurm_sweep(sweep_dir)
        returns: dict[int, JobReturn] = {}
        jobs: dict[int, MemberJob] = {}
        for num, (sweep_config, overrides) in configs.items():
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")

            def collect(cfg: DictConfig, num=num, overrides=overrides) -> None:
                run_dir = Path(HydraConfig.get().runtime.output_dir)
                jobs[num] = MemberJob(cfg, run_dir, list(overrides), num)

            returns[num] = run_job(
                hydra_context=self.hydra_context,
                task_function=collect,
                config=sweep_config,
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
            )
            configure_log(config.hydra.hydra_logging, config.hydra.verbose)

        # 3. each group trained as one ensemble
        from runtime.job import objective_value

        command = sweep_command(config, sweep_dir)
        for num in finished:
            job = jobs[num]
            returns[num].return_value = objective_value(job.cfg, job.run_dir) if job.cfg.objective else 0
        per_group = max(1, self.n_jobs // len(found))  # the n_jobs processes shared among the groups
        parts = [  # each group split into up to that many ensembles of consecutive jobs
            Part([jobs[num] for num in chunk], secrets.token_hex(4))
            for group in found
            for chunk in split(group.jobs, per_group)
        ]
        if self.n_jobs > 1:
            print(
                f"ensemble: {len(parts)} ensembles of {', '.join(str(len(p.jobs)) for p in parts)} members, {self.n_jobs} at a time"
            )
        for part, values in zip(parts, fit_parts(parts, sweep_dir, command, self.n_jobs)):
            for job, value in zip(part.jobs, values):
                returns[job.job_num].return_value = value
                returns[job.job_num].status = JobStatus.COMPLETED
        return [returns[num] for num in sorted(returns)]


def split(jobs: list[int], parts: int) -> list[list[int]]:
    """``jobs`` in up to ``parts`` runs of consecutive jobs, as even as can be (the first ones one longer)."""
    parts = max(1, min(parts, len(jobs)))
    size, extra = divmod(len(jobs), parts)
    cuts = [i * size + min(i, extra) for i in range(parts + 1)]
    return [jobs[cuts[i] : cuts[i + 1]] for i in range(parts)]
