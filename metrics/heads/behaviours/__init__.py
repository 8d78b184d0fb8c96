"""The head behaviours, one module each (:mod:`metrics.heads.behaviours.base`): every module here, and any
installed extension's, that subclasses :class:`~metrics.heads.behaviours.base.Behaviour` adds a behaviour
the tracker scores every head on."""
