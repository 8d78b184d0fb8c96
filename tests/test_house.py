"""The house's rules, read from the code: imports flow one way between rooms, train.py only composes
and fits, and one module names the files of a run directory."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import REPO

# Lower rooms first: a module may import its own room and rooms listed before it, never after.
ROOMS = [
    "data",
    "models",
    "metrics",
    "records",
    "reports",
    "callbacks",
    "conf",
    "analysis",
    "runtime",
    "bench",
    "train",
]


def imported_rooms(path: Path) -> set[str]:
    """The project rooms ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found & set(ROOMS)


def room_files(room: str) -> list[Path]:
    return [REPO / "train.py"] if room == "train" else sorted((REPO / room).rglob("*.py"))


def test_imports_flow_one_way_between_rooms():
    wrong = [
        f"{path.relative_to(REPO)} imports {other}"
        for rank, room in enumerate(ROOMS)
        for path in room_files(room)
        for other in imported_rooms(path)
        if ROOMS.index(other) > rank
    ]
    assert not wrong, "\n".join(wrong)


def test_every_room_is_ranked():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(ROOMS), packages - set(ROOMS)


def test_callbacks_holds_lightning_callbacks_only():
    """Every module of callbacks/ defines a Lightning callback, and none is a command or draws."""
    import importlib
    import inspect

    import lightning as L

    for path in room_files("callbacks"):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"callbacks.{path.stem}")
        defined = [v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == module.__name__]
        assert any(issubclass(c, L.Callback) for c in defined), f"{path.name} defines no Lightning callback"
        assert not hasattr(module, "main") and "matplotlib" not in path.read_text(), path.name


def test_train_py_only_composes_and_fits():
    text = (REPO / "train.py").read_text()
    assert len(text.splitlines()) <= 80
    assert (
        "except" not in text and "sys.exit" not in text and "os._exit" not in text
    )  # the exit policy is runtime/job.py


def test_one_module_names_the_files_of_a_run_directory():
    """No product module but records/layout.py spells a run file's name."""
    names = re.compile(
        r"""["'](status\.json|summary\.json|metrics\.csv|last\.ckpt|train\.log|phase_change\.png|composition\.png|"""
        r"""validity\.(csv|png)|pair_curves\.png|sweep_\w+\.(csv|png))["']|/ ["'](checkpoints|tensors|trajectory|analysis|csv)["']"""
    )
    spelled = [
        f"{path.relative_to(REPO)}:{number}"
        for room in ROOMS
        for path in room_files(room)
        if path != REPO / "records" / "layout.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if names.search(line.split("#")[0])
    ]
    assert not spelled, spelled


def test_tests_mirror_the_rooms_and_never_import_each_other():
    rooms = set(ROOMS) - {"train"}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        room = path.parent.name
        assert room in rooms or path.parent == REPO / "tests", f"{path.relative_to(REPO)} is in no room"
        imported = {
            node.module
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
        }
        others = [m for m in imported if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_")]
        assert not others, f"{path.relative_to(REPO)} imports {others}: shared code goes to tests/helpers.py"


STARTS_TRAIN_PY = {"run_train", "run_train_until", "sweep", "Popen"}


def is_slow(node: ast.FunctionDef, module_slow: bool) -> bool:
    return module_slow or any("slow" in ast.unparse(decorator) for decorator in node.decorator_list)


def test_every_test_that_starts_train_py_is_marked_slow():
    unmarked = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = "pytestmark = pytest.mark.slow" in path.read_text()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                calls = {ast.unparse(c.func).rsplit(".", 1)[-1] for c in ast.walk(node) if isinstance(c, ast.Call)}
                if calls & STARTS_TRAIN_PY and not is_slow(node, module_slow):
                    unmarked.append(f"{path.relative_to(REPO)}::{node.name}")
    assert not unmarked, unmarked
