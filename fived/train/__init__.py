"""The training loop, data, checkpoints and metrics."""
