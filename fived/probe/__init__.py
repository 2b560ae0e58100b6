"""This machine measured (``--gpu this-machine``): ``machine`` (the GEMM sweep, the traced
runtime's seconds per block, ranks sharing the cores) and ``kernels`` (the runtime's own
kernels traced and timed at their shapes). Measurement, not command-line code: the ledger
reads what they return and stays free of torch."""
