"""Extensions: modules of installed packages that add tasks, composition measures or tracked
quantities, named under the ``induction_composition_tracker`` entry points of their package::

    [project.entry-points.induction_composition_tracker]
    my_task = "my_package.my_task"

Importing such a module is what adds its task (a :class:`data.task.Task` subclass), its measure
(:func:`metrics.composition.measures.register_measure`) or its tracked quantity (a
:class:`metrics.tracked.base.TrackedQuantity` subclass); every registry loads them before it lists
its entries, and the config schema is built from the registries, so their options are config options
like any other (docs/operations.md, "Extending the tracker"). The loader sits in the lowest room so
that every registry can call it.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

ENTRY_POINTS = "induction_composition_tracker"


class ExtensionError(ImportError):
    """An extension that cannot be imported; the message names it and says why, in one line."""


def load_extensions() -> list[str]:
    """Import every extension module and return their names (a module imported before is not run again)."""
    loaded = []
    for point in entry_points(group=ENTRY_POINTS):
        try:
            importlib.import_module(point.value.split(":")[0])
        except Exception as error:  # any failure of someone else's module: named, in one line
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ExtensionError(f"extension {point.name} = {point.value!r} does not import: {reason}") from error
        loaded.append(point.value)
    return loaded
