"""Benchmarks against the PyTorch-native peers (``fived bench NAME``)."""
