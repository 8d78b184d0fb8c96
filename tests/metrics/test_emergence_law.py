"""The emergence law's fit (metrics/dynamics/emergence_law.py) against lifelines' log-normal AFT model,
on planted laws, and its refusals; the command (reports/emergence.py) on a sweep's run files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from metrics.dynamics.emergence_law import (
    Law,
    NoLaw,
    Observation,
    fit_censored_log_normal,
    fit_emergence_law,
    numeric_design,
)
from reports.emergence import main as emergence_main
from reports.explorer_page import emergence_section
from tests.helpers import require_extra

B, C = "data.batch_size", "data.seq_len"


def planted(alpha: float, beta, seeds: int = 3, sigma: float = 0.15, max_steps: float = math.inf, seed: int = 0):
    """Observations of ``steps = 400 (B/32)^α (C/33)^β e^(N(0, σ²))`` over B 8..64, C 17..129; censored past ``max_steps``."""
    rng = np.random.default_rng(seed)
    observations = []
    for b in (8, 16, 32, 64):
        for c in (17, 33, 65, 129):
            context = beta(c) if callable(beta) else beta * math.log(c / 33)
            for _ in range(seeds):
                t = 400 * (b / 32) ** alpha * math.exp(context + rng.normal(0, sigma))
                observations.append(Observation({B: b, C: c}, min(t, max_steps), t > max_steps, b * c))
    return observations


def test_the_censored_fit_and_its_standard_errors_are_lifelines_log_normal_aft():
    require_extra("lifelines", "dev")
    import pandas as pd
    from lifelines import LogNormalAFTFitter

    observations = planted(-0.5, 2.0, sigma=0.3, max_steps=1500)
    censored = np.array([o.censored for o in observations])
    assert 5 <= censored.sum() <= 20  # the planted law runs past max_steps in the long contexts
    log_t = np.log([o.step for o in observations])
    beta, sigma, covariance = fit_censored_log_normal(numeric_design(observations, [B, C]), log_t, censored)
    frame = pd.DataFrame(
        {
            "log_b": np.log([o.values[B] for o in observations]),
            "log_c": np.log([o.values[C] for o in observations]),
            "T": [o.step for o in observations],
            "E": ~censored,
        }
    )
    reference = LogNormalAFTFitter().fit(frame, duration_col="T", event_col="E")
    params = reference.params_
    assert beta[1] == pytest.approx(params[("mu_", "log_b")], abs=1e-4)
    assert beta[2] == pytest.approx(params[("mu_", "log_c")], abs=1e-4)
    assert beta[0] == pytest.approx(params[("mu_", "Intercept")], abs=1e-3)
    assert sigma == pytest.approx(math.exp(params[("sigma_", "Intercept")]), rel=1e-3)
    errors = reference.standard_errors_  # the observed information, through the change of parameters
    assert np.sqrt(np.diag(covariance)) == pytest.approx(
        [errors[("mu_", "Intercept")], errors[("mu_", "log_b")], errors[("mu_", "log_c")]], rel=1e-3
    )


def test_planted_laws_are_recovered_with_intervals_that_hold_them_and_their_tokens_exponents_are_one_more():
    """20 planted sweeps (B^-½ C^2, ~40 % of the jobs past max_steps): the estimates centre on the planted
    exponents, the 90 % intervals hold them in at least 16 (bench.emergence_validity: 87-94 of 100)."""
    estimates, covered = [], 0
    for seed in range(20):
        observations = planted(-0.5, 2.0, max_steps=1500, seed=seed)
        law = fit_emergence_law(observations, resamples=100, seed=seed)
        assert isinstance(law, Law) and law.censored > 10
        estimates.append([law.exponents[B].estimate, law.exponents[C].estimate])
        covered += law.exponents[B].covers(-0.5) and law.exponents[C].covers(2.0)
        if seed == 0:
            tokens = fit_emergence_law(observations, "tokens", resamples=100)
            for variable in (B, C):  # tokens = steps · B · C: each exponent one more
                assert tokens.exponents[variable].estimate == pytest.approx(
                    law.exponents[variable].estimate + 1, abs=1e-6
                )
    assert np.mean(estimates, axis=0) == pytest.approx([-0.5, 2.0], abs=0.02)
    assert covered >= 16, covered


def test_a_law_that_bends_is_said_to_bend_and_a_straight_one_is_not():
    bent = fit_emergence_law(planted(-0.5, lambda c: 2 * max(math.log(c / 33), 0.0), seed=2), resamples=300)
    straight = fit_emergence_law(planted(-0.5, 2.0, seed=2), resamples=300)
    assert bent.bends(C) and not straight.bends(C) and not bent.bends(B)
    local = [e.exponent.estimate for e in bent.local[C]]
    assert local[0] == pytest.approx(0.0, abs=0.3) and local[-1] == pytest.approx(2.0, abs=0.3)


@pytest.mark.parametrize(
    "observations, reason",
    [
        ([Observation({B: 32.0}, 400.0)] * 4, "one value per variable in all 4 jobs"),
        ([Observation({B: b}, 400.0) for b in (8.0, 16.0, 32.0)], "a single seed in each of the 3 cells"),
        ([Observation({B: b}, 1500.0, True) for b in (8.0, 8.0, 16.0, 16.0)], "no phase change in any of the 4 jobs"),
    ],
    ids=["one value", "one seed", "no phase change"],
)
def test_a_sweep_that_cannot_carry_a_law_says_why(observations, reason):
    law = fit_emergence_law(observations, resamples=100)
    assert isinstance(law, NoLaw) and reason in law.reason


def fake_sweep(root, observations, max_steps=1500):
    """A sweep's run directories as train.py leaves them, holding the planted steps: the files the report reads."""
    for k, o in enumerate(observations):
        run = root / str(k)
        (run / ".hydra").mkdir(parents=True)
        overrides = [f"{B}={int(o.values[B])}", f"{C}={int(o.values[C])}", f"seed={k % 3}"]
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        config = {
            "seed": k % 3,
            "data": {"batch_size": int(o.values[B]), "seq_len": int(o.values[C])},
            "trainer": {"max_steps": max_steps, "accumulate_grad_batches": 1},
        }
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "status.json").write_text(json.dumps({"status": "finished", "exit_code": 0}))
        summary = (
            {}
            if o.censored
            else {"phase_change/loss_midpoint_step": o.step, "phase_change/loss_onset_step": o.step * 0.9}
        )
        (run / "summary.json").write_text(json.dumps(summary))


def test_the_command_fits_a_sweeps_files_and_writes_its_table_record_and_figure(tmp_path, capsys):
    observations = planted(-0.5, -0.5, seed=3, max_steps=700)
    fake_sweep(tmp_path, observations, max_steps=700)
    assert emergence_main([str(tmp_path), "--resamples", "200"]) == 0
    printed = capsys.readouterr().out
    assert "Aoyama et al. 2025 -0.5: consistent; Musat et al. 2025 +2: rejected" in printed
    for name in ("emergence.csv", "emergence.json", "emergence.png"):
        assert (tmp_path / name).is_file(), name
    record = json.loads((tmp_path / "emergence.json").read_text())
    (midpoint,) = [law for law in record["laws"] if law["event"] == "midpoint" and law["unit"] == "steps"]
    assert midpoint["censored"] == sum(o.censored for o in observations) > 0
    for variable in (B, C):
        exponent = midpoint["exponents"][variable]
        assert exponent["low90"] < -0.5 < exponent["high90"], (variable, exponent)
    # the sweep's explorer page shows the same: every exponent, and each variable's steps one line per value
    # of the other, with the law drawn through them
    section = emergence_section(record)
    (row,) = [r for r in section["rows"] if r["event"] == "midpoint" and r["unit"] == "steps" and r["variable"] == B]
    assert row["exponent"] == midpoint["exponents"][B]["estimate"] and "Musat" not in row["predictions"]
    lines = section["charts"][B]
    assert len(lines) == len({o.values[C] for o in observations})  # one per context
    assert sum(len(line["x"]) for line in lines) == len(observations)
    for line in lines:
        c = float(line["stratum"].split("=")[1])
        law = math.exp(midpoint["intercept"]) * line["fit"]["x"][0] ** midpoint["exponents"][B]["estimate"]
        assert line["fit"]["y"][0] == pytest.approx(law * c ** midpoint["exponents"][C]["estimate"])


def test_the_command_on_a_sweep_without_a_phase_change_is_one_line_and_fails(tmp_path, capsys):
    fake_sweep(tmp_path, [Observation({B: b, C: 33.0}, 1500.0, True) for b in (8.0, 8.0, 16.0, 16.0)])
    assert emergence_main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    (line,) = [line for line in captured.out.splitlines() if "no law" in line]
    assert line.strip().startswith(
        "no law for midpoint, onset, induction midpoint, induction onset: no phase change in any of the 4 jobs"
    ), line
    assert captured.err == ""


def test_an_out_that_is_a_file_is_refused_in_one_line_and_left_as_it_was(tmp_path, capsys):
    fake_sweep(tmp_path / "sweep", planted(-0.5, -0.5, seed=3))
    summary = tmp_path / "sweep" / "0" / "summary.json"
    before = summary.read_bytes()
    assert emergence_main([str(tmp_path / "sweep"), "--out", str(summary)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --out") and "is a file" in line
    assert summary.read_bytes() == before and not list((tmp_path / "sweep").glob("emergence.*"))
