"""Benchmarks: each fived dimension against its PyTorch-native peer, in one run, as ratios."""
