"""Memory accounting: the model-state bytes a rank holds, from the tensors themselves, and the
peak of its transient buffers.

Model-state bytes per rank (Ψ parameters; P = param bytes, G = grad bytes, M = 4 for an fp32
master, 2 for Kahan's bf16 compensation, 0 otherwise; 8 for Adam m and v):

    ZeRO-0: (P + G + M + 8)·Ψ        ZeRO-1: (P + G)·Ψ + (M + 8)·Ψ/N
    ZeRO-2: P·Ψ + (G + M + 8)·Ψ/N    ZeRO-3: (P + G + M + 8)·Ψ/N

ZeRO-1/2 with the fp8 gather hold their fp8 linears' weights (Ψ_f8) as P·Ψ_f8/N (the owned
shard) + 1·Ψ_f8 (the whole e4m3 cast) + 4 bytes per tile scale, instead of P·Ψ_f8
(``Sharding.param_extra``). Plus ``padding`` (a full buffer's pad — the e4m3 cast's too —, a
shard's pad/N; the scales have none), so every rank's keys = formula + padding exactly.
``buffers`` is the step's peak of transient buffers (``Buffers``: ZeRO-2/3's full
gradient buckets, ZeRO-3's gathered units), reset to what is live at ``zero_grad``.
"""

from __future__ import annotations

from typing import Any

import torch

from .buckets import Bucket, nbytes


class Buffers:
    """Bytes of transient buffers live now, and their peak since the step began."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def hold(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def release(self, n: int) -> None:
        self.live -= n

    def reset(self) -> None:
        self.peak = self.live


class StateAccount:
    """``memory()``: params, grads, master, optimizer, buffers, padding, in bytes."""

    def __init__(self, buckets: list[Bucket], sharding: Any, grads: Any, masters: Any,
                 buffers: Buffers):
        self.buckets, self.sharding, self.grads = buckets, sharding, grads
        self.masters, self.buffers = masters, buffers  # masters.opt may be replaced: read late

    def state_tensors(self, i: int) -> list[torch.Tensor]:
        """Every model-state tensor of bucket ``i``: params, grads, master, Adam m and v."""
        b = self.buckets[i]
        casts = [t for t in self.sharding.param_extra(b) if t.dtype == torch.uint8]
        out = [self.sharding.param_state(b), *casts, self.grads.state(b)]
        if self.masters.policy.separate_master:
            out.append(b.master)
        if b.comp is not None:
            out.append(b.comp)
        return out + self.masters.opt.flat_state(i)

    def padding_bytes(self) -> float:
        """Bytes of padding in the states this rank holds; a shard's padding is counted as its
        1/N share, so that every rank's bytes = formula(Ψ) + padding exactly."""
        total = 0.0
        for i, b in enumerate(self.buckets):
            if not b.pad:
                continue
            for t in self.state_tensors(i):
                per = t.element_size()
                total += b.pad * per if t.numel() == b.padded else b.pad * per / b.shards
        return total

    def memory(self) -> dict[str, Any]:
        """Bytes this rank holds, from the tensors themselves."""
        master = (sum(nbytes(b.master) for b in self.buckets)
                  if self.masters.policy.separate_master else 0)
        master += sum(nbytes(b.comp) for b in self.buckets if b.comp is not None)
        return {
            "params": sum(nbytes(self.sharding.param_state(b))
                          + sum(nbytes(t) for t in self.sharding.param_extra(b))
                          for b in self.buckets),
            "grads": sum(nbytes(self.grads.state(b)) for b in self.buckets),
            "master": master,
            "optimizer": self.masters.opt.state_bytes(),
            "buffers": self.buffers.peak,
            "padding": self.padding_bytes(),
        }
