"""Benchmarks run by ``fived bench NAME``: each module ``NAME`` has ``main(argv) -> int``.

``comm``: collectives swept over sizes as nccl-tests does (algbw, busbw, alpha-beta fit), for the
backend's own collectives and fived's ring built from send/recv. Import nothing heavy here:
``fived bench NAME`` should print its header before torch loads.
"""
