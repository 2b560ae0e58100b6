"""The training loop, its data and its metrics."""
