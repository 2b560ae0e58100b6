"""Data parallelism: gradients summed over the ranks that hold the same parameters, with ZeRO
sharding and mixed precision (``fived.parallel.precision``), on flat buckets.

    ddp.py         ZeRO-0 (``DDP``): all-reduce; 2(N−1)/N · grad bytes sent per rank per step
    zero12.py      ZeRO-1/2 (``Zero1``, ``Zero2``): reduce-scatter + all-gather;
                   (N−1)/N · (grad bytes + param bytes)
    zero3.py       ZeRO-3 (``Zero3``): per-unit gather/free with prefetch; (3Ψ − Ψ_root)(N−1)/N · P
    base.py        the engine: the pieces composed, the public surface (docs/engine.md)
    protocols.py   what a stage chooses: Sharding, GradStore, ParamGather (+ NoGather)
    layout.py      bucket layout and build (born sharded)
    grads.py       gradient storage: FullGrads (ZeRO-0/1), ShardGrads (ZeRO-2/3)
    reduce.py      the reduction: hooks, launch order, overlap, finish
    master.py      masters, loss scale, norm, clip, optimizer step
    accounting.py  model-state bytes (memory()), the transient buffers' peak
    buckets.py     the flat buckets and their padding

Model states per parameter: (P + G + M + 8)Ψ with ZeRO-0; ZeRO-1 divides M + 8 by N, ZeRO-2
also G, ZeRO-3 also P (P, G, M: param, grad, fp32-master bytes; 8: Adam m, v).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...config import ConfigError
from ..placement import Placement
from .base import DataParallel
from .buckets import Bucket
from .ddp import DDP
from .zero3 import Zero3
from .zero12 import Zero1, Zero2

ENGINES: dict[int, type[DataParallel]] = {0: DDP, 1: Zero1, 2: Zero2, 3: Zero3}


def make_engine(model: nn.Module, grid: Any, par: Any, train: Any,
                placements: dict[str, Placement], units: list[nn.Module] | None = None,
                source: Any = None, device: Any = None) -> DataParallel:
    """The data-parallel engine for ``par.zero`` (DDP, ZeRO-1, 2 or 3), any precision.

    ``placements``: every trainable parameter's ``Placement``, keyed by its name in
    ``model.named_parameters()``; ``units``: ZeRO-3's gather units in forward order (the
    transformer blocks; parameters in no unit form the root unit); ``source``: what fills the
    parameters still on the meta device, on ``device`` (born sharded: ``base.build_state``)."""
    if par.zero not in ENGINES:
        raise ConfigError([f"--zero {par.zero}: ZeRO stages are 0, 1, 2, 3"])
    return ENGINES[par.zero](model, grid, par, train, placements, units, source, device)


__all__ = ["DDP", "ENGINES", "Bucket", "DataParallel", "Zero1", "Zero2", "Zero3", "make_engine"]
