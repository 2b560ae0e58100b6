"""Benchmarks: each fived dimension against its PyTorch-native peer, in one run, as ratios."""

# modules the others share, not benchmarks: `fived bench` neither lists nor runs them
NOT_COMMANDS = ("harness", "schema")
