"""Typed schemas for every config group. Hydra merges each group's YAML onto these dataclasses,
so a misspelt key, a wrong type or an unknown enum value fails before anything is built."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from data.task import Task, tasks
from metrics.composition.measures import MEASURES
from metrics.dynamics.llc import LLCUnavailable, require_devinterp
from metrics.tracked.base import tracked_quantities
from metrics.tracked.options import TrackerOptions
from models.interventions import CIRCUITS, KEEPS, KINDS, REPLACEMENTS, TARGETS, Intervention
from models.optimizer import OptimizerSettings
from models.transformer import TransformerShape, init_problems


class Normalization(str, Enum):
    none = "none"
    layernorm = "layernorm"
    rmsnorm = "rmsnorm"


class Positions(str, Enum):
    standard = "standard"  # added to the residual stream
    shortformer = "shortformer"  # added to the queries' and keys' inputs only (aslvrstn 2022's EasyTransformer run)


class InitScheme(str, Enum):
    fan_in = "fan_in"  # N(0, 1/fan-in)
    normal = "normal"  # every W_* N(0, init_std²)
    gpt2 = "gpt2"  # every W_* N(0, (0.8/sqrt(d_model))²): EasyTransformer's init_mode="gpt2"


ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "auto")
PRECISIONS = ("32-true", "32", "64-true", "64", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class ModelConfig:
    n_layers: int = 2
    n_heads: int = 2
    d_model: int = 64
    d_head: int = 16
    n_ctx: int = II("data.seq_len")  # the context: the task's sequence length unless set (33 by default)
    d_vocab: int = 257  # random tokens + BOS
    normalization: Normalization = Normalization.none
    positions: Positions = Positions.standard
    biases: bool = False  # b_Q, b_K, b_V, b_O per layer and b_U: start at 0, trained
    init: InitScheme = InitScheme.fan_in
    init_std: float | None = None  # with init=normal: every W_* N(0, init_std²) (aslvrstn 2022: 0.02)

    def problems(self) -> list[str]:
        """The model's sizes and options as :class:`~models.transformer.TransformerShape` and the
        initialisation check them, every problem at once."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerShape)}
        init = str(getattr(self.init, "value", self.init))  # an enum in the schema, its value once built
        problems = TransformerShape.check(**fields) + init_problems(init, self.init_std)
        return [f"model.{problem}" for problem in problems]


@dataclass
class TrainerConfig:
    max_steps: int = 1500
    accelerator: str = "cpu"
    devices: int = 1
    precision: str = "32-true"
    gradient_clip_val: float | None = 1.0
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True  # a bar on a terminal; in a log file, a line every progress_every_n_steps
    progress_every_n_steps: int = 100
    deterministic: bool = False
    checkpoint_every_n_steps: int = 500
    num_threads: int | None = None  # torch threads; None: torch's default, or the cores' share of a parallel sweep job

    def problems(self) -> list[str]:
        positive = ("max_steps", "devices", "accumulate_grad_batches", "log_every_n_steps", "checkpoint_every_n_steps")
        problems = [
            f"trainer.{key}={getattr(self, key)} must be >= 1"
            for key in (*positive, "progress_every_n_steps")
            if getattr(self, key) < 1
        ]
        if self.num_threads is not None and self.num_threads < 1:
            problems.append(f"trainer.num_threads={self.num_threads} must be >= 1 (or null: automatic)")
        if self.accelerator not in ACCELERATORS:
            problems.append(f"trainer.accelerator={self.accelerator!r} must be one of {ACCELERATORS}")
        if self.precision not in PRECISIONS:
            problems.append(f"trainer.precision={self.precision!r} must be one of {PRECISIONS}")
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            problems.append(f"trainer.gradient_clip_val={self.gradient_clip_val} must be > 0 (or null: no clipping)")
        return problems


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: WandbMode | None = None  # None: $WANDB_MODE if set, else offline
    # online: a W&B server silent this long means an offline run (and a `wandb sync` hint)
    connect_timeout_s: float = 10.0
    project: str = "induction-composition"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    name: str | None = None


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv: bool = True

    def problems(self) -> list[str]:
        problems = []
        if self.wandb.enabled and not str(self.wandb.project).strip():
            problems.append("logger.wandb.project is empty: name a project (or logger=csv for no W&B)")
        if self.wandb.connect_timeout_s <= 0:
            problems.append(f"logger.wandb.connect_timeout_s={self.wandb.connect_timeout_s} must be > 0")
        return problems


def tracker_config() -> type:
    """The ``tracker`` section's schema, learnt from what owns each option: the tracker's own options
    (:class:`metrics.tracked.options.TrackerOptions`), the composition's at its root (``tracker.measures``,
    ...), and a node ``tracker.NAME`` of every tracked quantity and measure with options of its own
    (``tracker.ablation``, ``tracker.share``; an extension's too: :mod:`registry.extensions`)."""
    quantities = tracked_quantities()
    roots = tuple(q.Options for q in quantities.values() if q.root_options)
    own = [
        (name, owner.Options)
        for name, owner in [*quantities.items(), *MEASURES.items()]
        if getattr(owner, "Options", None) is not None and not getattr(owner, "root_options", False)
    ]
    taken = {f.name for base in (TrackerOptions, *roots) for f in dataclasses.fields(base)}
    if clash := sorted(taken & {name for name, _ in own}):
        raise ValueError(f"tracked quantities or measures named like tracker options: {clash}")
    nodes = [(name, options, field(default_factory=options)) for name, options in own]
    schema = dataclasses.make_dataclass("TrackerConfig", nodes, bases=(TrackerOptions, *roots))
    schema.__module__ = __name__  # pickled configs (sweep launchers) find it here
    return schema


TrackerConfig = tracker_config()


class TrajectoryTrigger(str, Enum):
    """What starts keeping the weights at every tracker step (callbacks.trajectory_recorder.PhaseTrigger)."""

    repeated_loss = "repeated_loss"  # the probe's repeated-token loss starts its fall
    induction_score = "induction_score"  # the top induction score starts its rise
    none = "none"  # no densification: the log-spaced and linear grids only


@dataclass
class TrajectoryConfig:
    """The weights kept over training (``RUN_DIR/trajectory/``, safetensors, weights only): log-spaced
    steps, a linear grid, every tracker step through a phase change, and the last step."""

    enabled: bool = True
    log_steps: int = 20  # log-spaced steps in [1, max_steps] (and step 0)
    every_n_steps: int = 100  # the linear grid (0: none)
    trigger: TrajectoryTrigger = TrajectoryTrigger.repeated_loss
    # start: a fall of this share of the first step's loss (or a rise of this much induction score)
    threshold: float = 0.05
    settle: float = 0.05  # end: over the last `window` tracker steps, a move under this share of the change so far
    window: int = 3  # tracker steps averaged (trailing) before the trigger reads them
    look_back: int = 5  # tracker steps held in memory, written when the trigger fires (it fires a little late)
    # thins the linear grid first, then the log-spaced one; half is kept for the phase change.
    # None: 40 MB, raised for a larger model to hold 16 of its steps (records/trajectory.py, default_budget)
    budget_mb: float | None = None

    def problems(self) -> list[str]:
        """Out-of-range values (the budget against the model's size: conf/validate.py)."""
        lows = (("log_steps", 0), ("every_n_steps", 0), ("window", 1), ("look_back", 0))
        problems = [f"trajectory.{k}={getattr(self, k)} must be >= {low}" for k, low in lows if getattr(self, k) < low]
        for key in ("threshold", "settle", "budget_mb"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):  # a budget of None follows the model
                problems.append(f"trajectory.{key}={value} must be a finite number > 0")
        return problems


@dataclass
class LLCConfig:
    """SGLD settings of the local learning coefficient (metrics.dynamics.llc; devinterp, the ``llc``
    extra). The defaults are the calibration's pick on the default experiment
    (``python -m analysis.calibrate_llc RUN_DIR``; docs/results.md, "Developmental stages")."""

    lr: float = 1e-3  # ε, the SGLD step
    localization: float = 100.0  # γ, the pull back to the weights being measured
    # nβ; None: n / ln n with n = batch_size, the sequences of one SGLD batch (devinterp's default_nbeta,
    # Hoogland et al. 2024; why: metrics/dynamics/llc.py, "Which n nβ stands for")
    n_beta: float | None = None
    chains: int = 4
    draws: int = 100
    burnin: int = 20  # steps before the draws, left out of the estimate
    batch_size: int = 32
    batches: int = 8  # the sampled set: batches × batch_size held-out sequences of the run's training data
    seed: int = 0
    settle_tolerance: float = 0.1  # an estimate whose loss trace drifts more (a share of λ̂) is flagged
    # also every head's and every layer's weight-refined LLC (Wang et al. 2024), the model's with them in
    # one batched SGLD run (metrics/dynamics/refined_llc.py)
    heads: bool = True
    # the data-refined LLCs too: every head's and layer's with the loss on each of these components of a
    # mixture task (data=mixture), e.g. [repeated, markov_icl]
    data_refined: list[str] = field(default_factory=list)
    # during training: λ̂ every this many steps, logged as llc/* (0: only afterwards, by analysis.stages)
    every_n_steps: int = 0
    # n_layers, n_heads, d_model, d_head of the model lr and localization were calibrated on: another
    # size gets one warning line (conf/validate.py, llc_calibration_warning)
    calibrated_on: list[int] = field(default_factory=lambda: [2, 2, 64, 16])

    def problems(self) -> list[str]:
        problems = [
            f"stages.llc.{k}={getattr(self, k)}: must be >= 1"
            for k in ("chains", "batch_size", "batches")
            if getattr(self, k) < 1
        ]
        if self.draws < 3:
            problems.append(f"stages.llc.draws={self.draws}: must be >= 3")
        if self.burnin < 0:
            problems.append(f"stages.llc.burnin={self.burnin}: must be >= 0")
        for name in ("lr", "localization", "settle_tolerance"):
            value = getattr(self, name)
            if not value >= 0 or (name == "lr" and value == 0):
                problems.append(f"stages.llc.{name}={value}: must be {'> 0' if name == 'lr' else '>= 0'}")
        if self.n_beta is not None and not self.n_beta > 0:
            problems.append(f"stages.llc.n_beta={self.n_beta}: must be > 0 (or null for batch_size / ln batch_size)")
        if self.n_beta is None and self.batch_size < 2:
            problems.append(
                "stages.llc.batch_size=1 leaves nβ = batch_size / ln(batch_size) undefined: set stages.llc.n_beta"
            )
        if self.chains == 1:
            problems.append(
                f"stages.llc.chains={self.chains}: the LLC's boundaries need the spread of at least 2 chains"
            )
        if self.every_n_steps < 0:
            problems.append(f"stages.llc.every_n_steps={self.every_n_steps}: must be >= 0 (0: not during training)")
        elif self.every_n_steps > 0:
            try:
                require_devinterp()
            except LLCUnavailable as error:
                problems.append(f"stages.llc.every_n_steps={self.every_n_steps}: {error}")
        return problems


@dataclass
class StagesConfig:
    """Developmental stages from the saved weights (``python -m analysis.stages RUN_DIR``): the LLC
    and essential dynamics over the trajectory, and the boundaries where they turn; with
    ``llc.every_n_steps`` the LLC during training too."""

    llc: LLCConfig = field(default_factory=LLCConfig)
    llc_enabled: bool = True  # false: essential dynamics only (no devinterp needed)
    sequences: int = 64  # essential dynamics: fixed held-out sequences whose per-token losses are tracked
    components: int = 3  # principal components of the essential dynamics (only those that beat the null are read)
    # stage boundaries (metrics.dynamics.stages; docs/results.md, "Developmental stages": the nulls)
    bandwidth: float = 0.25  # the LLC's smoothing: the kernel's half-width in ln(step + 1)
    alpha: float = 0.01  # the chance that noise alone gives a boundary, per signal
    plateau: float = 0.1  # the LLC is on a plateau where its slope is under this share of its largest significant slope
    min_share: float = 0.05  # a boundary of the essential dynamics must carry this share of the trajectory's variance
    resamples: int = 200  # bootstrap resamples (chains; tokens) behind each boundary's support and interval
    min_support: float = 0.5  # a boundary is kept when at least this share of the resamples finds it again

    def problems(self) -> list[str]:
        """Every out-of-range setting (``analysis.stages``, and the LLC during training), one message
        each; asking for the LLC during training without the ``llc`` extra is one of them."""
        problems = self.llc.problems()
        if self.sequences < 1:
            problems.append(f"stages.sequences={self.sequences}: must be >= 1")
        if self.components < 2:
            problems.append(f"stages.components={self.components}: must be >= 2")
        if not self.bandwidth > 0:
            problems.append(f"stages.bandwidth={self.bandwidth}: must be > 0 (a half-width in ln(step + 1))")
        for name in ("alpha", "plateau", "min_share"):
            if not 0 < getattr(self, name) < 1:
                problems.append(f"stages.{name}={getattr(self, name)}: must be in (0, 1)")
        if not 0 <= self.min_support <= 1:
            problems.append(f"stages.min_support={self.min_support}: must be in [0, 1]")
        if self.resamples < 0:
            problems.append(f"stages.resamples={self.resamples}: must be >= 0")
        return problems


InterventionKind = Enum("InterventionKind", [(k, k) for k in KINDS], type=str)
PatternTarget = Enum("PatternTarget", [(t, t) for t in TARGETS], type=str)
AblationReplacement = Enum("AblationReplacement", [(r, r) for r in REPLACEMENTS], type=str)
AblationKeep = Enum("AblationKeep", [(k, k) for k in KEEPS], type=str)
FrozenCircuit = Enum("FrozenCircuit", [(c, c) for c in CIRCUITS], type=str)
"""The intervention options' values: ``models/interventions.py`` says what each does."""


NO_INTERVENTION = Intervention()
"""Where every intervention option's default is written (models/interventions.py)."""


@dataclass
class InterventionSpec:
    """One intervention during training (``models/interventions.py``, ``callbacks/interventions.py``):
    each kind reads its own options, the rest are ignored."""

    kind: InterventionKind = InterventionKind(NO_INTERVENTION.kind)
    # L0H1 (a head), L0 (every head of layer 0), top_prev_token / top_induction (the model's top head at from_step)
    heads: list[str] = field(default_factory=list)
    from_step: int = NO_INTERVENTION.from_step
    until_step: int | None = NO_INTERVENTION.until_step  # active while from_step <= step < until_step; None: to the end
    target: PatternTarget = PatternTarget(NO_INTERVENTION.target)  # clamp: the pattern imposed
    strength: float = NO_INTERVENTION.strength  # clamp: (1 - strength)·own pattern + strength·target
    # ablate: zero, the batch mean, another sequence's
    replacement: AblationReplacement = AblationReplacement(NO_INTERVENTION.replacement)
    keep: AblationKeep = AblationKeep(
        NO_INTERVENTION.keep
    )  # ablate: none (the output), pattern (values), values (pattern)
    circuit: FrozenCircuit = FrozenCircuit(NO_INTERVENTION.circuit)  # freeze: qk, ov or both
    factor: float = NO_INTERVENTION.factor  # temperature: the scores are multiplied by it
    source: str | None = NO_INTERVENTION.source  # graft: a run directory with trajectory/
    source_step: int | None = NO_INTERVENTION.source_step  # graft: its saved step to copy (None: its last)
    frozen: bool = NO_INTERVENTION.frozen  # graft: hold the grafted weights until until_step


@dataclass
class InterventionConfig(InterventionSpec):
    also: list[InterventionSpec] = field(default_factory=list)  # more interventions at once


@dataclass
class Config:
    seed: int = 0
    resume: str | None = None  # a run directory to continue in place, or a checkpoint to continue from in a new one
    resume_allow_changes: bool = False  # let a resume change seed, model, data, optim or tracker settings
    objective: str | None = None  # what a sweep job returns to an optimizing sweeper: a summary.json or config key
    # with objective: a run whose loss cliff (midpoint) is later, or absent, scores NaN
    objective_cliff_by: int | None = None
    explorer: bool = True  # write RUN_DIR/explorer.html at the end of the run (analysis/explorer.py)
    # draw the end-of-run figures (phase_change.png, composition.png, ...); false: the summary, validity table
    # and W&B's numbers only, the figures drawn later by `python -m reports.run_report RUN_DIR` (sweeps of many jobs),
    # and a sweep's end its tables only (`python -m reports.sweep_report SWEEP_DIR` draws its figures)
    figures: bool = True
    model: ModelConfig = MISSING
    optim: OptimizerSettings = field(default_factory=OptimizerSettings)
    data: Any = MISSING  # a task's own options (data/task.py): the data group stores each task's dataclass
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    tracker: Any = MISSING  # TrackerConfig, stored anew by register_schemas (an extension's options with it)
    trajectory: TrajectoryConfig = field(default_factory=TrajectoryConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    intervention: InterventionConfig = MISSING


RENAMED = {
    "tracker.share_rows": "tracker.share.rows",
    "tracker.share_centre": "tracker.share.centre",
    "tracker.share_floor": "tracker.share.floor",
}
"""Options an earlier version named otherwise: its name -> this version's."""
RETIRED = ("stages.window", "stages.min_turn")
"""Options an earlier version had that no version reads now (the turning-point finder's)."""


def upgraded(saved: dict) -> dict:
    """A resolved config an earlier version wrote (a run's, a checkpoint's), in this version's keys:
    renamed options moved, retired ones dropped (a copy; ``saved`` is left as it is)."""
    config = copy.deepcopy(saved)
    for old, new in RENAMED.items():
        (section, name), (_, new_section, new_name) = old.split("."), new.split(".")
        if name in config.get(section, {}):
            config[section].setdefault(new_section, {})[new_name] = config[section].pop(name)
    for key in RETIRED:
        section, name = key.split(".")
        config.get(section, {}).pop(name, None)
    return config


def typed_tracker(node) -> DictConfig:
    """A saved run's ``tracker`` section on this version's schema (an option it does not know, e.g. of
    an extension not installed now, is left out)."""
    known = {f.name for f in dataclasses.fields(TrackerConfig)}
    given = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})
    return OmegaConf.merge(OmegaConf.structured(TrackerConfig), {k: v for k, v in given.items() if k in known})


def task_node(task: type[Task]) -> DictConfig:
    """The config node of a task: its dataclass, its seed following the run's (``${seed}``)."""
    node = OmegaConf.structured(task)
    node.seed = "${seed}"
    return node


def register_schemas() -> None:
    """Make the schemas available to ``conf/config.yaml`` and each group's YAML files; every task
    (the built-in ones and the extensions', registry/extensions.py) is an option of the data group."""
    global TrackerConfig
    TrackerConfig = tracker_config()  # again: an extension imported since adds its options
    store = ConfigStore.instance()
    for name, task in tasks().items():
        store.store(group="data", name=name, node=task_node(task))
    store.store(name="schema", node=Config)
    for group, node in [
        ("model", ModelConfig),
        ("trainer", TrainerConfig),
        ("logger", LoggerConfig),
        ("tracker", TrackerConfig),
        ("intervention", InterventionConfig),
    ]:
        store.store(group=group, name="schema", node=node)
