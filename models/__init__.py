"""The attention-only transformer and its LightningModule."""
