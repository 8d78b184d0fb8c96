"""Pure functions: weights or attention patterns in, tensors out. No Lightning, no logging, no I/O."""
