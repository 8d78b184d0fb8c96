"""The house's rules, read from the code: imports flow one way between rooms, train.py only composes
and fits, and one module names the files of a run directory."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import REPO

# Lower rooms first: a module may import its own room and rooms listed before it, never after.
ROOMS = [
    "registry",
    "data",
    "models",
    "metrics",
    "records",
    "conf",
    "reports",
    "callbacks",
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


FILE_LIKE = re.compile(r"\.(json|csv|png|safetensors|ckpt|yaml)$")
NOT_A_RUN_FILE = {
    "metrics/disk_cache.py": "the random baselines' and behaviour nulls' cache in the user's cache directory, below records/",
}


def docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def test_one_module_names_every_file_a_run_an_analysis_or_a_sweep_writes():
    """No string in product code (docstrings aside, f-string parts included) ends in a file
    extension, but in records/layout.py."""
    spelled = []
    for room in ROOMS:
        for path in room_files(room):
            relative = str(path.relative_to(REPO))
            if relative == "records/layout.py" or relative in NOT_A_RUN_FILE or room == "bench":
                continue
            tree = ast.parse(path.read_text())
            skip = docstrings(tree)
            spelled += [
                f"{relative}:{node.lineno} {node.value!r}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in skip
                and FILE_LIKE.search(node.value.strip())
            ]
    assert not spelled, spelled


def layout_file_names() -> set[str]:
    """Every file or folder name records/layout.py defines (its string constants, paths' last parts)."""
    from records import layout

    names = set()
    for key, value in vars(layout).items():
        values = value if isinstance(value, tuple) else (value,)
        if key.isupper():
            names |= {Path(v).name for v in values if isinstance(v, (str, Path)) and key != "RUN_KEY"}
    return names | {layout.step_file(0).replace("00000000", "*"), layout.measurements_dir(Path("analysis/NAME")).name}


def test_the_docs_layout_table_names_every_file_of_records_layout_and_no_other():
    text = (REPO / "docs" / "operations.md").read_text()
    table = text[text.index("## What a run writes") : text.index("\n## ", text.index("## What a run writes") + 1)]
    names = layout_file_names()
    assert not [name for name in sorted(names) if f"{name}" not in table], (
        "docs/operations.md's layout table lacks these"
    )
    given = {Path(token).name for token in re.findall(r"`([^`\s]+)`", table) if FILE_LIKE.search(token)}
    assert given <= names, given - names
    readme = (REPO / "README.md").read_text()
    in_readme = {Path(token).name for token in re.findall(r"`([^`\s]+)`", readme) if FILE_LIKE.search(token)}
    assert in_readme <= names, in_readme - names


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


STARTS_TRAIN_PY = {"run_train", "run_train_process", "run_train_until", "run_tiny_sweep", "sweep", "Popen", "popen"}


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


def test_the_docs_count_the_measures_there_are():
    """Every "N measures" the README and docs/ say in words is the number the tracker has."""
    from metrics.composition.measures import WEIGHT_MEASURES

    words = "one two three four five six seven eight nine ten eleven twelve".split()
    said = {
        f"{path.name}: {match.group(0)}"
        for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for match in re.finditer(r"\b(all |the )?(" + "|".join(words) + r") measures\b", path.read_text())
        if words.index(match.group(2)) + 1 != len(WEIGHT_MEASURES) and match.group(1)
    }
    assert not said, said
