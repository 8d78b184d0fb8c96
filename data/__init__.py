"""Induction-data generators, the probe batch and the datamodule."""
