"""Where the registries find their entries: every registry (tasks, composition measures, tracked quantities,
head behaviours) lists the subclasses of its base class once its built-in modules and the installed
extensions are imported (:mod:`registry.extensions`). The lowest room: every other may use it."""
