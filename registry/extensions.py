"""Extensions: modules of installed packages that add tasks, composition measures, tracked quantities
or head behaviours, named under the ``induction_composition_tracker`` entry points of their package::

    [project.entry-points.induction_composition_tracker]
    my_task = "my_package.my_task"

Importing such a module is what adds its task (a :class:`data.task.Task` subclass), its measure
(:func:`metrics.composition.measures.register_measure`), its tracked quantity (a
:class:`metrics.tracked.base.TrackedQuantity` subclass) or its head behaviour (a
:class:`metrics.heads.behaviours.base.Behaviour` subclass); every registry loads them before it lists
its entries, and the config schema is built from the registries, so their options are config options
like any other (docs/operations.md, "Extending the tracker"). The loader sits in the lowest room so
that every registry can call it.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from functools import cache
from importlib.metadata import EntryPoint, entry_points

ENTRY_POINTS = "induction_composition_tracker"


class ExtensionError(ImportError):
    """An extension that cannot be imported; the message names it and says why, in one line."""


def load_extensions() -> list[str]:
    """Import every extension module and return their names (a module imported before is not run again)."""
    loaded = []
    for point in extension_points(tuple(sys.path)):
        try:
            importlib.import_module(point.value.split(":")[0])
        except Exception as error:  # any failure of someone else's module: named, in one line
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ExtensionError(f"extension {point.name} = {point.value!r} does not import: {reason}") from error
        loaded.append(point.value)
    return loaded


@cache
def extension_points(path: tuple[str, ...]) -> tuple[EntryPoint, ...]:
    """The extensions' entry points of the distributions installed on ``path`` (``sys.path``, the key
    of this cache: ``entry_points`` reads it), found once per path. Every registry asks before it
    lists its entries, two dozen times in a tracked run, and each scan of every installed
    distribution's metadata takes 13-24 ms. A distribution installed into a folder already on the
    path while the process runs is found by the next process."""
    return tuple(entry_points(group=ENTRY_POINTS))


def registered(base: type, package: str, kind: str, first: tuple[str, ...] = ()) -> dict[str, type]:
    """Every subclass of ``base`` (at any depth) with a ``name``, by name, each after the class it
    derives from, once every module of the built-in ``package`` (the modules ``first`` first, the
    others by name) and every extension is imported. ``ValueError`` when two ``kind`` share a name."""
    modules = importlib.import_module(package).__path__
    for module in (*first, *sorted(m.name for m in pkgutil.iter_modules(modules) if m.name not in first)):
        importlib.import_module(f"{package}.{module}")
    load_extensions()
    found: dict[str, type] = {}

    def collect(cls: type) -> None:
        if cls.name:
            if found.get(cls.name, cls) is not cls:
                raise ValueError(f"two {kind} are named {cls.name!r}: {found[cls.name].__module__}, {cls.__module__}")
            found[cls.name] = cls
        for subclass in cls.__subclasses__():
            collect(subclass)

    for subclass in base.__subclasses__():
        collect(subclass)
    return found
