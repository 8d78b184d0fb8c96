"""The ensemble launcher (``hydra/launcher=ensemble``)."""
