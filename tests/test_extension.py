"""The house open to new questions: a composition measure, a per-head score with its own schedule, a
task with its own probe and option and a head behaviour that task adds, each one module of an installed
package found by its entry point (registry/extensions.py), none of them known to this repository; a real
train.py run with all four logs them everywhere a run writes, and a bad value of each is one line of
error before any work."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest
import torch

from metrics.heads.behaviour import BUILT_IN_BEHAVIOURS
from records import wandb_records
from records.tensor_store import read_tensor_store, tensor_labels
from records.trajectory import Trajectory
from reports.head_types import read_head_history
from reports.run_report import read_series
from tests import warm_start
from tests.helpers import REPO, WITH_WANDB, run_train_process, train_env

MEASURE = '''
"""The best writer direction's Frobenius ratio with the reader: one function, one registration."""
from metrics.composition.measures import Measure, PairStats, register_measure


def top_direction_score(p: PairStats):
    return (p.row_energy[..., 0] / p.reader_sq.sum(-1)).sqrt()


register_measure(Measure("top_direction", top_direction_score))
'''

SCORE = '''
"""Mean attention to the first position (BOS), every 20 steps unless told."""
from dataclasses import dataclass

from metrics.tracked.base import Every, PerHead, TrackedQuantity


@dataclass
class BosOptions(Every):
    every_n_steps: int = 20


class BosAttention(TrackedQuantity):
    name = "bos_attention"
    Options = BosOptions
    summary = ("heads/bos_attention/top",)

    def measure(self, run):
        return run.patterns[..., 1:, 0].mean(dim=(-1, -3)).cpu()  # (L, H): over queries >= 1 and sequences

    def outputs(self, result, run):
        return [PerHead("heads/bos_attention", result)]
'''

TASK = '''
"""A block, ``gap`` filler tokens, the block again; its probe has the same gap."""
from dataclasses import dataclass

import numpy as np
import torch

from data.counter_rng import random_ints
from data.probe import ProbeBatch
from data.task import Task


def gapped(seed, ids, n, gap, n_random, rows_long):
    draws = torch.from_numpy(random_ints(seed, np.asarray(ids), n + gap, n_random))
    block, filler = draws[:, :n], draws[:, n:]
    body = torch.cat([block, filler, block], dim=1)
    bos = torch.full((len(ids), 1), n_random, dtype=torch.long)
    return torch.cat([bos, body], dim=1)[:, :rows_long]


@dataclass
class GappedCopy(Task):
    name: str = "gapped_copy"
    gap: int = 3

    def problems(self, n_random, n_ctx):
        problems = super().problems(n_random, n_ctx)
        if self.gap < 0:
            problems.append(f"data.gap={self.gap} must be >= 0")
        return problems

    def sampler(self, n_random):
        n = (self.seq_len - 1 - self.gap) // 2
        return lambda ids: gapped(self.seed, ids, n, self.gap, n_random, self.seq_len)

    def probe(self, seed, batch_size, n, n_random):
        tokens = gapped(seed + 12345, np.arange(batch_size), n, self.gap, n_random, 1 + 2 * n + self.gap)
        return ProbeBatch(tokens, n, first_start=1, gap=self.gap)
'''

BEHAVIOUR = '''
"""Two-back heads, read on the gapped copy only: from each query to the token two before it."""
from metrics.heads.behaviours.base import Behaviour


class TwoBack(Behaviour):
    name = "two_back"
    colour = "tab:cyan"
    tasks = ("gapped_copy",)

    @staticmethod
    def targets(relations):
        return relations.positional(relations.key == relations.query - 2)
'''

ENTRY_POINTS = """
[induction_composition_tracker]
measure = ext_pkg.my_measure
score = ext_pkg.my_score
task = ext_pkg.my_task
behaviour = ext_pkg.my_behaviour
"""

RUN = [
    WITH_WANDB,  # the extensions' keys reach W&B
    "data=gapped_copy",
    "data.gap=2",
    "model.n_ctx=40",
    "data.seq_len=39",
    "tracker.probe_n=12",
    "tracker.measures=[frobenius,top_direction]",
    "tracker.dense_measures=[frobenius,top_direction]",
    "trainer.max_steps=40",
    "tracker.every_n_steps=10",
    "tracker.ablation.every_n_steps=20",
    "tracker.images.every_n_steps=0",
    "trajectory.log_steps=2",
    "trajectory.every_n_steps=20",
]


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    """An installed package, as pip leaves one: the modules and a dist-info naming them as entry points."""
    root = tmp_path_factory.mktemp("site")
    package = root / "ext_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in (("my_measure", MEASURE), ("my_score", SCORE), ("my_task", TASK), ("my_behaviour", BEHAVIOUR)):
        (package / f"{name}.py").write_text(textwrap.dedent(text).lstrip())
    info = root / "ext_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ext-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS.lstrip())
    return root


def env_with(root) -> dict[str, str]:
    return train_env(PYTHONPATH=f"{root}:{REPO}")


@pytest.fixture(scope="module")
def trained(extension, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    result = run_train_process(RUN, run_dir, env=env_with(extension))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_the_extensions_reach_wandb_the_csv_the_store_and_the_summary(trained):
    (run_file,) = trained.glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_records.history(run_file)
    steps_of = lambda key: sorted(row["trainer/global_step"] for row in history if key in row)
    assert steps_of("4_heads/heads/bos_attention/top") == [0, 20, 40]  # its own schedule
    assert steps_of("1_story/heads/induction/top") == [0, 10, 20, 30, 40]  # the tracker's
    assert steps_of("5_pairs/comp/K/top_direction/L0H1->L1H0") == [0, 10, 20, 30, 40]
    assert steps_of("3_ground_truth/validity/loss_change/top_direction/rank_of_truth") == [0, 20, 40]
    config = wandb_records.config(run_file)
    assert config["data"]["name"] == "gapped_copy" and config["data"]["gap"] == 2
    assert config["tracker"]["bos_attention"]["every_n_steps"] == 20
    series = read_series(trained / "csv" / "metrics.csv")
    assert series["heads/bos_attention/L1H0"][0].tolist() == [0, 20, 40]
    assert "comp/baseline/top_direction" in series and "circuit/K/top_direction_minus_baseline" in series
    store = read_tensor_store(trained / "tensors")
    assert store["heads/bos_attention"][1].shape == (3, 2, 2) and store["comp/K/top_direction"][1].shape[1:] == (
        2,
        2,
        2,
        2,
    )
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["final/heads/bos_attention/top"] == pytest.approx(series["heads/bos_attention/top"][1][-1])
    assert "validity/top_direction/final_spearman_loss" in summary


@pytest.fixture(scope="module")
def read_with_the_extension(extension) -> dict:
    """What a process that has the extension reads (one process for both: its imports are ~5 s): the task's
    probe (``probe``: gap, repeat start, tokens) and, on the gapped copy and on the repeated tokens, the
    behaviours a head is scored and typed by (``behaviours``)."""
    code = f"""
import json, torch
from conf.schema import register_schemas
from conf.objects import build_probe
from data.task import tasks
from metrics.tracked.head_behaviour import HeadBehaviour
from tests.helpers import composed
register_schemas()
probe = build_probe(composed(*{RUN!r}))
tokens = torch.randint(0, 8, (4, 12), generator=torch.Generator().manual_seed(0))
behaviours = {{}}
for task in ("gapped_copy", "repeated"):
    targets, typed_by, _, _ = HeadBehaviour().for_task(tasks()[task](), n_random=8).targets_of(tokens, torch.device("cpu"))
    behaviours[task] = {{"scored": list(targets.names), "typed_by": list(typed_by)}}
print(json.dumps({{"probe": [probe.gap, probe.repeat_start, probe.tokens.tolist()], "behaviours": behaviours}}))
"""
    out = warm_start.run([sys.executable, "-c", code], REPO, env_with(extension), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_new_score_is_the_attention_to_bos_of_the_saved_weights_on_the_tasks_probe(
    trained, read_with_the_extension
):
    """The last logged score, recomputed by hand from the saved final weights on the task's own
    probe (gap 2: the repeat starts 2 tokens after the block): an independent reading."""
    gap, repeat_start, tokens = read_with_the_extension["probe"]
    assert (gap, repeat_start) == (2, 1 + 12 + 2)
    tokens = torch.tensor(tokens)
    assert torch.equal(tokens[:, 1:13], tokens[:, 15:27])  # the block, the gap, the block again
    model = Trajectory(trained).model(40)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, head_out=False)
    by_hand = torch.stack([p[..., 1:, 0].mean(dim=(-1, 0)) for p in cache["pattern"]])  # (L, H)
    logged = read_tensor_store(trained / "tensors")["heads/bos_attention"][1][-1]
    np.testing.assert_allclose(logged, by_hand.numpy(), rtol=1e-5, atol=1e-7)
    # the task's own behaviour: each head's mean attention two tokens back, over queries >= 2 and the probe
    by_hand = torch.stack([p.diagonal(offset=-2, dim1=-2, dim2=-1).mean(dim=(-1, 0)) for p in cache["pattern"]])
    names = tensor_labels(trained / "tensors")["heads/behaviour/scores"]
    assert names == [*BUILT_IN_BEHAVIOURS, "two_back"]
    logged = read_tensor_store(trained / "tensors")["heads/behaviour/scores"][1][-1][..., names.index("two_back")]
    np.testing.assert_allclose(logged, by_hand.numpy(), rtol=1e-5, atol=1e-7)


def history_names(run_dir) -> list[str]:
    return tensor_labels(run_dir / "tensors")["heads/behaviour/per_sequence"]


@pytest.mark.slow
def test_the_tasks_behaviour_is_scored_typed_and_drawn_on_its_task_only(trained, read_with_the_extension):
    """``two_back`` names the gapped copy: its run logs and types heads by it, its report and page read
    the labelled axis; on another task (the repeated tokens', in a process that has the extension) it is
    neither scored nor stored, so no report can type a head by it."""
    series = read_series(trained / "csv" / "metrics.csv")
    assert series["heads/two_back/top"][0].tolist() == [0, 10, 20, 30, 40]
    assert series["heads/behaviour/count/two_back"][0].tolist() == [0, 10, 20, 30, 40]
    summary = json.loads((trained / "summary.json").read_text())
    assert {summary[f"heads/type/L{l}H{h}"] for l in (0, 1) for h in (0, 1)} <= {
        "unspecialised",
        *history_names(trained),
    }
    history = read_head_history(trained / "tensors")
    assert "two_back" in history.behaviours and history.type_names[-1] == "two_back"
    read = read_with_the_extension["behaviours"]
    assert (
        read["gapped_copy"]["scored"] == [*BUILT_IN_BEHAVIOURS, "two_back"]
        and "two_back" in read["gapped_copy"]["typed_by"]
    )
    assert read["repeated"]["scored"] == list(BUILT_IN_BEHAVIOURS)  # neither scored, stored nor typed elsewhere


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.gap=-1"], "data.gap=-1 must be >= 0"),
        (["tracker.bos_attention.every_n_steps=15"], "tracker.bos_attention.every_n_steps=15 must be a multiple of"),
        (["tracker.measures=[top_directio]"], "tracker.measures has unknown ['top_directio']"),
    ],
)
def test_a_bad_value_of_each_is_one_line_before_any_work(extension, tmp_path, overrides, message):
    run_dir = tmp_path / "never"
    result = run_train_process([*RUN, *overrides], run_dir, env=env_with(extension))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert not run_dir.exists()
