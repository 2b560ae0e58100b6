"""fived.comm: the only package that calls torch.distributed collectives.

Import the submodules directly (``fived.comm.ops``, ``fived.comm.volume`` ...); this package file
stays empty so that ``fived.comm.volume`` can be used by the ledger without importing torch.
"""
