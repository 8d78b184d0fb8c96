"""Hydra configuration: typed schemas (``schema.py``), cross-field checks (``validate.py``) and
the builders that turn a validated config into the objects ``train.py`` fits (``build.py``)."""
