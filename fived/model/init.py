"""Layout-independent initialisation: each full parameter is drawn from (seed, parameter name).

A rank that holds a slice of a parameter draws the full tensor with the same generator and keeps
its slice, so any layout, any pipeline split and any resharded checkpoint start from the same
model. The generator is seeded by a stable hash (CRC-32 of ``"{seed}/{name}"``), never by
Python's randomised ``hash``.
"""

from __future__ import annotations

import zlib

import torch


def param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode()) + (int(seed) << 32)


def full_param(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """The full fp32 tensor for parameter ``name``: N(0, std²), or ones when ``std`` is 0."""
    if std == 0.0:
        return torch.ones(shape, dtype=torch.float32)
    g = torch.Generator().manual_seed(param_seed(seed, name) % (2**63))
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


def shard(full: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """The ``index``-th of ``parts`` equal chunks of ``full`` along ``dim`` (a copy)."""
    if parts == 1:
        return full
    return full.chunk(parts, dim=dim)[index].clone().contiguous()
