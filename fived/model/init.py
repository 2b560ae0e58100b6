"""Layout-independent initialisation: each full parameter is drawn from (seed, parameter name).

Every rank builds the same full model and draws each parameter with a generator seeded by a
stable hash (CRC-32 of ``"{seed}/{name}"``, never Python's randomised ``hash``); the parallel
dimensions then keep their slices. So any layout and any pipeline split start from the same
model.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn


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


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std_of) -> nn.Module:
    """Draw every parameter of ``model`` from (seed, its name); ``std_of(name)`` gives its std."""
    for name, p in model.named_parameters():
        p.copy_(full_param(seed, name, tuple(p.shape), std_of(name)).to(p.dtype))
    return model
