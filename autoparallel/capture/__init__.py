"""Stage 1, capture: trace one training step into a joint forward+backward
FX graph (tracing, the wrappers around the user's model, activation
checkpointing, saved activations, repeated layers)."""
