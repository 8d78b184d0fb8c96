"""Per-head and per-pair circuit scores: attention-pattern scores, copying and matching, the circuit pair."""
