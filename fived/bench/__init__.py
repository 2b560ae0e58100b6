"""Benchmarks: ``fived bench NAME`` runs ``fived.bench.NAME.main(argv)``."""
