"""Training-curve analysis: loss views on the probe batch and phase-change detection."""
