"""The run's tensor store, the heatmap images drawn without matplotlib, and the end-of-run report
drawn from the store when the CSV has no per-pair keys."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from metrics.dynamics.phase_change import SMOOTHING_WINDOW
from records.heatmap_pixels import BACKGROUND, LOOKUP_TABLE, MASKED, SEPARATOR, heatmap_image, symmetric_limit
from records.layout import TENSORS_DIR
from records.tensor_store import TensorStore, read_tensor_store, snapshot_tensors, tensor_labels
from reports import run_report as figure
from tests.helpers import fake_snapshot

# --- the store -----------------------------------------------------------------------------------


def test_round_trip_with_slashes_in_names(tmp_path):
    rng = np.random.default_rng(0)
    records = {
        step: {"comp/K/frobenius": rng.standard_normal((2, 3, 2, 3)), "loss": np.float64(step / 7)}
        for step in (0, 10, 20)
    }
    with TensorStore(tmp_path) as store:
        for step, tensors in records.items():
            store.append(step, tensors)
    stored = read_tensor_store(tmp_path)
    steps, values = stored["comp/K/frobenius"]
    assert steps.dtype == np.int64 and steps.tolist() == [0, 10, 20]
    assert values.dtype == np.float32 and values.shape == (3, 2, 3, 2, 3)
    np.testing.assert_array_equal(values[1], records[10]["comp/K/frobenius"].astype(np.float32))
    assert stored["loss"][1].shape == (3,) and stored["loss"][1][2] == np.float32(20 / 7)
    assert all(path.is_file() for path in tmp_path.iterdir())  # "/" made no sub-folders
    assert (tmp_path / "comp%2FK%2Ffrobenius.f32").stat().st_size == 3 * 36 * 4  # 4 bytes a value, no header
    mapped = read_tensor_store(tmp_path, names=["comp/K/frobenius", "missing"], mmap=True)
    assert list(mapped) == ["comp/K/frobenius"]
    np.testing.assert_array_equal(mapped["comp/K/frobenius"][1], values)


def test_each_name_has_its_own_steps(tmp_path):
    store = TensorStore(tmp_path)
    for step in range(0, 60, 10):
        tensors = {"comp/K/frobenius": np.full((2,), step)}
        if step % 50 == 0:  # measured less often, like the ablation
            tensors["ablation/loss_change"] = np.full((3,), -step)
        store.append(step, tensors)
    store.close()
    stored = read_tensor_store(tmp_path)
    assert stored["comp/K/frobenius"][0].tolist() == [0, 10, 20, 30, 40, 50]
    assert stored["ablation/loss_change"][0].tolist() == [0, 50]
    assert stored["ablation/loss_change"][1][:, 0].tolist() == [0, -50]


def test_a_torn_last_record_is_ignored_then_cut_off(tmp_path):
    with TensorStore(tmp_path) as store:
        store.append(0, {"a/b": np.arange(4.0), "c": np.ones(1)})
        store.append(1, {"a/b": np.arange(4.0) + 1, "c": np.ones(1)})
    with open(tmp_path / "a%2Fb.f32", "ab") as handle:  # killed mid-append: half the values, no step
        handle.write(np.arange(2, dtype=np.float32).tobytes())
    with open(tmp_path / "c.f32", "ab") as handle:  # killed between the values and the step: 3 bytes of it
        handle.write(np.ones(1, dtype=np.float32).tobytes())
    with open(tmp_path / "c.steps", "ab") as handle:
        handle.write(b"\x02\x00\x00")
    stored = read_tensor_store(tmp_path)
    assert stored["a/b"][0].tolist() == [0, 1] and stored["a/b"][1][1].tolist() == [1, 2, 3, 4]
    assert stored["c"][0].tolist() == [0, 1]
    with TensorStore(tmp_path) as store:  # reopening cuts the torn tails: the next record lands aligned
        store.append(2, {"a/b": np.full(4, 9.0), "c": np.full(1, 9.0)})
    stored = read_tensor_store(tmp_path)
    assert stored["a/b"][0].tolist() == [0, 1, 2] and stored["a/b"][1][2].tolist() == [9, 9, 9, 9]
    assert stored["c"][0].tolist() == [0, 1, 2] and stored["c"][1][:, 0].tolist() == [1, 1, 9]


def test_truncate_after_drops_later_records_for_a_resume(tmp_path):
    store = TensorStore(tmp_path)
    for step in (0, 10, 20, 30):
        store.append(step, {"x": np.full(2, step), **({"rare": np.full(1, step)} if step in (0, 30) else {})})
    store.truncate_after(15)
    stored = read_tensor_store(tmp_path)
    assert stored["x"][0].tolist() == [0, 10] and stored["x"][1][:, 0].tolist() == [0, 10]
    assert stored["rare"][0].tolist() == [0]
    with pytest.raises(ValueError, match="not after"):
        store.append(10, {"x": np.zeros(2)})
    store.append(20, {"x": np.full(2, 21)})
    store.truncate_after(-1)  # everything
    store.append(0, {"rare": np.full(1, 5)})
    store.close()
    stored = read_tensor_store(tmp_path)
    assert stored["x"][0].tolist() == [] and stored["x"][1].shape == (0, 2)
    assert stored["rare"][1].tolist() == [[5]]


def test_a_bad_record_writes_nothing(tmp_path):
    with TensorStore(tmp_path) as store:
        store.append(0, {"x": np.zeros((2, 2)), "y": np.zeros(3)})
        with pytest.raises(ValueError, match="shape"):
            store.append(1, {"y": np.ones(3), "x": np.zeros(4)})
    stored = read_tensor_store(tmp_path)
    assert stored["x"][0].tolist() == [0] and stored["y"][0].tolist() == [0]  # y not written either


def test_a_labelled_axis_is_kept_reopened_and_must_stay_the_same(tmp_path):
    """A tensor's last axis named (the behaviours a run scored) is read back after a reopen (a resume); a
    record with other labels writes nothing; a name stored without labels has none."""
    names = ("previous_token", "two_back")
    with TensorStore(tmp_path) as store:
        store.append(0, {"scores": np.zeros((2, 2)), "plain": np.zeros(1)}, {"scores": names})
    with TensorStore(tmp_path) as store:
        store.append(1, {"scores": np.ones((2, 2))}, {"scores": names})
        with pytest.raises(ValueError, match="labels"):
            store.append(2, {"scores": np.ones((2, 2)), "plain": np.ones(1)}, {"scores": names[::-1]})
        with pytest.raises(ValueError, match="two_back', 'three_back'"):  # an axis grown: named, not only its shape
            store.append(2, {"scores": np.ones((2, 3))}, {"scores": (*names, "three_back")})
    assert tensor_labels(tmp_path) == {"scores": list(names)}
    stored = read_tensor_store(tmp_path)
    assert stored["scores"][0].tolist() == [0, 1] and stored["plain"][0].tolist() == [0]


def test_names_that_differ_only_in_case_get_their_own_files(tmp_path):
    with TensorStore(tmp_path) as store:
        store.append(0, {"comp/K/x": np.ones(1), "comp/k/x": np.full(1, 2.0)})
    files = {entry["file"].lower() for entry in json.loads((tmp_path / "index.json").read_text())["tensors"].values()}
    assert len(files) == 2  # distinct even on a case-insensitive filesystem
    stored = read_tensor_store(tmp_path)
    assert stored["comp/K/x"][1].tolist() == [[1]] and stored["comp/k/x"][1].tolist() == [[2]]


def test_snapshot_tensors_names_shapes_and_values(tmp_path):
    snap = fake_snapshot(3, 2, ("frobenius", "subspace"))
    tensors = snapshot_tensors(snap.outputs)
    assert sorted(tensors) == sorted(
        [f"comp/{k}/{m}" for m in ("frobenius", "subspace") for k in "QKV"]
        + [
            "comp/baseline/frobenius",
            "comp/baseline/subspace",
            "match",
            "ablation/loss_change",
            "ablation/pattern_change",
        ]
        + [f"heads/{s}" for s in ("prev_token", "current_token", "first_token", "duplicate", "induction")]
        + [f"heads/{s}" for s in ("copying", "ov_copying", "successor")]
        + [f"heads/writes/{s}" for s in ("scores", "null_mean", "null_std")]
        + [f"strategies/per_sequence/{s}" for s in ("uniform", "copy", "induction")]
        + [f"heads/behaviour/{s}" for s in ("scores", "type", "per_sequence", "null_mean", "null_std")]
    )
    assert tensors["strategies/per_sequence/copy"].shape == (8,)
    assert tensors["heads/behaviour/per_sequence"].shape == (3, 4, 2, 6) and tensors["heads/behaviour/type"].shape == (
        3,
        2,
    )
    assert tensors["comp/K/subspace"].shape == (3, 2, 3, 2) and tensors["heads/induction"].shape == (3, 2)
    assert tensors["comp/baseline/subspace"].tolist() == [0.11, 0.001]
    with TensorStore(tmp_path) as store:
        store.append(30, tensors)
    steps, values = read_tensor_store(tmp_path)["comp/K/subspace"]
    np.testing.assert_array_equal(
        values[0], snap["composition"].scores["subspace"]["K"].float().numpy()
    )  # NaN where masked
    assert np.isnan(values[0, 2, 0, 1, 1]) and steps.tolist() == [30]
    partial = snapshot_tensors(fake_snapshot(2, 2, ("frobenius",), ablation=None, writes=None, matching=None).outputs)
    assert not [name for name in partial if name.startswith(("ablation", "match", "heads/copying", "heads/writes"))]


# --- heatmap images ------------------------------------------------------------------------------


def rgb(index: int) -> list[int]:
    return LOOKUP_TABLE[index].tolist()


def test_heatmap_image_layout_and_colours():
    """3 layers x 2 heads: 4 writers x 4 readers per panel, 5-pixel cells, a line between layers."""
    snap = fake_snapshot(3, 2, ("frobenius",))
    scores = {kind: snap["composition"].scores["frobenius"][kind].numpy() - 0.5 for kind in "QK"}
    scores["K"][0, 1, 2, 0] = 2.0  # writer row 1, reader column 2 (L2H0): the largest |value|
    scores["K"][0, 0, 1, 1] = -2.0  # writer row 0, reader column 1 (L1H1)
    scores["Q"][1, 0, 2, 1] = 0.0  # writer row 2 (L1H0), reader column 3
    image = heatmap_image(scores, cell_pixels=5)
    side = 4 * 5 + 1
    assert image.dtype == np.uint8 and image.shape == (side, 2 * side + 8, 3)
    k = image[:, side + 8 :]
    pixel = lambda panel, row, col: panel[row * 5 + row // 2 + 2, col * 5 + col // 2 + 2].tolist()  # a cell's middle
    assert pixel(k, 1, 2) == [103, 0, 31] and rgb(250) == [103, 0, 31]  # +limit: the darkest red
    assert pixel(k, 0, 1) == [5, 48, 97]  # -limit: the darkest blue
    assert pixel(image, 2, 3) == [247, 247, 247]  # 0: white, the middle level
    assert pixel(k, 2, 0) == rgb(MASKED) == [217, 217, 217]  # L1H0 -> L1H0: not a later layer, grey
    assert k[10, :].tolist() == [rgb(SEPARATOR)] * side  # the line after layer 0's writers
    assert image[:, side : side + 8].reshape(-1, 3).tolist() == [rgb(BACKGROUND)] * (side * 8)
    assert symmetric_limit(scores) == 2.0
    halved = heatmap_image(scores, limit=1.0, cell_pixels=5)  # beyond the limit saturates
    assert pixel(halved[:, side + 8 :], 1, 2) == [103, 0, 31]


def test_heatmap_image_default_cells_and_one_layer():
    snap = fake_snapshot(2, 2, ("frobenius",))
    scores = {kind: snap["composition"].scores["frobenius"][kind].numpy() for kind in "QKV"}
    assert heatmap_image(scores).shape == (96, 3 * 96 + 2 * 8, 3)  # 48-pixel cells for a 2 x 2 grid
    big = fake_snapshot(12, 12, ("frobenius",))
    image = heatmap_image({kind: big["composition"].scores["frobenius"][kind].numpy() for kind in "QKV"})
    assert image.shape == (132 * 4 + 10, 3 * 538 + 16, 3)  # 4-pixel cells, 10 lines between 11 writer layers
    with pytest.raises(ValueError, match="one-layer"):
        heatmap_image({"K": np.full((1, 2, 1, 2), np.nan)})


# --- the end-of-run report from the store ----------------------------------------------------------

STEPS = np.arange(0, 410, 10)


def write_run(run_dir, n_layers: int, n_heads: int, per_pair_csv: bool = False, store: bool = True) -> np.ndarray:
    """A finished run's CSV (summary-mode keys, or per-pair keys) and tensor store with a loss cliff
    at step 200; returns the stored K-composition ``[steps, L, H, L, H]``."""
    rng = np.random.default_rng(0)
    cliff = 1 / (1 + np.exp(-(STEPS - 200) / 15.0))
    k = (
        np.stack(
            [
                fake_snapshot(n_layers, n_heads, ("frobenius",), seed=i)["composition"].scores["frobenius"]["K"].numpy()
                for i in range(len(STEPS))
            ]
        ).astype(np.float32)
        * 0.1
        + 0.1
    )
    k[:, 0, 1, 1, 0] += 0.3 * cliff  # the circuit pair grows through the cliff
    columns = {
        "loss/repeated": 5.5 - 5.3 * cliff + 0.01 * rng.standard_normal(len(STEPS)),
        "loss/first_occurrence": np.full(len(STEPS), 5.5),
        "heads/induction/top": 0.8 * cliff,
        "heads/prev_token/top": 0.6 * cliff,
        "comp/baseline/frobenius": np.full(len(STEPS), 0.125),
        "circuit/K/frobenius": k[:, 0, 1, 1, 0],
        "circuit/K/frobenius_minus_baseline": k[:, 0, 1, 1, 0] - 0.125,
    }
    flat = k.reshape(len(STEPS), -1)
    if per_pair_csv:
        columns["comp/K/frobenius_minus_baseline/L0H0->L1H0"] = k[:, 0, 0, 1, 0] - 0.125
    else:
        columns["comp/K/frobenius_minus_baseline/max"] = np.nanmax(flat, axis=1) - 0.125
        columns["comp/K/frobenius_minus_baseline/mean"] = np.nanmean(flat, axis=1) - 0.125
    (run_dir / "csv").mkdir(parents=True)
    with open(run_dir / "csv" / "metrics.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", *columns])
        writer.writerows([step, *(float(c[i]) for c in columns.values())] for i, step in enumerate(STEPS))
    if store:
        with TensorStore(run_dir / TENSORS_DIR) as tensors:
            for i, step in enumerate(STEPS):
                tensors.append(
                    int(step),
                    {f"comp/{kind}/frobenius": k[i] * (0.5 if kind == "Q" else 1) for kind in "QKV"}
                    | {"comp/baseline/frobenius": np.array([0.125, 0.001])},
                )
    return k


def test_other_pairs_come_from_the_store_when_the_csv_has_none(tmp_path):
    k = write_run(tmp_path, 3, 6)  # 108 pairs: more than the 100 grey curves drawn
    series = figure.read_series(tmp_path / "csv" / "metrics.csv")
    others = figure.other_pairs(series, tmp_path / TENSORS_DIR, "frobenius")
    assert len(others.curves) == figure.MAX_GREY_CURVES == 100 and "100 of 108" in others.label
    scored = k.reshape(len(STEPS), -1)[:, ~np.isnan(k[0].reshape(-1))].astype(np.float64) - 0.125
    steps, low, high = others.band
    assert steps.tolist() == STEPS.tolist()
    np.testing.assert_allclose(high, scored.max(axis=1))
    np.testing.assert_allclose(low, scored.min(axis=1))
    circuit_curve = k[:, 0, 1, 1, 0].astype(np.float64) - 0.125  # the highest peak: drawn first
    np.testing.assert_allclose(others.curves[0][1], circuit_curve)
    few = figure.stored_other_pairs(STEPS.astype(float), k[:, :2], 0.125)  # 2 layers of 3: 36 pairs, all drawn
    assert len(few.curves) == 36 and few.band is None


def test_other_pairs_fall_back_to_the_csv(tmp_path):
    write_run(tmp_path / "pairs", 2, 2, per_pair_csv=True, store=False)
    series = figure.read_series(tmp_path / "pairs" / "csv" / "metrics.csv")
    others = figure.other_pairs(series, tmp_path / "pairs" / TENSORS_DIR, "frobenius")
    assert len(others.curves) == 1 and others.label == "other pairs, minus baseline"
    write_run(tmp_path / "summary", 3, 6, store=False)
    series = figure.read_series(tmp_path / "summary" / "csv" / "metrics.csv")
    others = figure.other_pairs(series, tmp_path / "summary" / TENSORS_DIR, "frobenius")
    assert [curve[1][-1] for curve in others.curves] == [
        series["comp/K/frobenius_minus_baseline/max"][1][-1],
        series["comp/K/frobenius_minus_baseline/mean"][1][-1],
    ]


def test_render_draws_the_final_composition_from_the_store(tmp_path):
    k = write_run(tmp_path, 3, 6)
    report = figure.render(tmp_path, SMOOTHING_WINDOW)
    assert report.figure.read_bytes()[:4] == b"\x89PNG"
    assert (
        report.composition_figure == tmp_path / "composition.png"
        and report.composition_figure.read_bytes()[:4] == b"\x89PNG"
    )
    assert (
        report.no_validity_because == "the ablation was off (tracker.ablation.every_n_steps=0)"
    )  # pairs, from the summary keys
    by_measure, step = figure.final_composition(
        tmp_path / TENSORS_DIR, figure.read_series(tmp_path / "csv" / "metrics.csv")
    )
    assert step == 400 and list(by_measure) == ["frobenius"] and list(by_measure["frobenius"]) == ["Q", "K", "V"]
    np.testing.assert_allclose(by_measure["frobenius"]["K"], k[-1] - 0.125, rtol=1e-6)
    assert report.summary["phase_change/loss_midpoint_step"] == pytest.approx(200, abs=30)


def test_figure_command_without_a_store_draws_no_composition(tmp_path, capsys):
    """``python -m reports.run_report RUN_DIR``'s entry point, in process (a subprocess costs ~15 s of imports here)."""
    write_run(tmp_path, 2, 2, per_pair_csv=True, store=False)
    assert figure.main([str(tmp_path)]) == 0
    assert (tmp_path / "phase_change.png").is_file() and not (tmp_path / "composition.png").exists()
    printed = capsys.readouterr().out
    assert "final/loss/repeated" in printed and "final composition" not in printed
    write_run(tmp_path / "stored", 3, 2)
    assert figure.main([str(tmp_path / "stored")]) == 0
    assert f"final composition: {tmp_path / 'stored' / 'composition.png'}" in capsys.readouterr().out
