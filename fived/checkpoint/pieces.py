"""This rank's pieces of a global tensor, in the form ``torch.distributed.checkpoint`` (DCP)
plans with: boxes ``(offsets, sizes)`` of the global shape, each with the local tensor.

A parameter's tensor-/expert-parallel piece is a regular chunk (``Placement``: chunk ``index``
of ``parts`` along ``dim``), but a ZeRO shard is an arbitrary *element range* ``[a, b)`` of the
flat bucket, so it may start and end in the middle of a row. A contiguous element range of a
row-major tensor of shape ``S`` is the union of at most ``2·ndim − 1`` boxes (``boxes``):

    [a, b) in shape (n, *rest):   the tail of row ⌊a/R⌋  +  the whole rows between
                                  +  the head of row ⌊b/R⌋        (R = ∏ rest; recursively)

Each box is itself contiguous in the flat buffer, so its data is a *view* of the shard: saving
copies nothing and sends nothing (no gather over the ZeRO group), and loading writes straight
into the shard. Shifting the boxes by the piece's offset along ``dim`` gives global boxes, which
is all DCP needs: it records every box of every rank under the global name and shape, drops
duplicates (replicas write identical boxes), and on load intersects the boxes a rank asks for
with the boxes on disk, whatever layout wrote them.

``Pieces`` implements DCP's ``__create_write_items__`` / ``__create_chunk_list__`` /
``__get_tensor_shard__`` protocol (the one ``DTensor`` uses), without a device mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def boxes(shape: tuple[int, ...], a: int, b: int) -> list[Box]:
    """The boxes covering elements [a, b) of a row-major tensor of ``shape``, in flat order."""
    if a >= b:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((a,), (b - a,))]
    inner = math.prod(shape[1:])
    r0, r1 = a // inner, b // inner
    if r0 == r1:
        return [((r0, *o), (1, *s)) for o, s in boxes(shape[1:], a - r0 * inner, b - r0 * inner)]
    out: list[Box] = []
    if a % inner:
        out += [((r0, *o), (1, *s)) for o, s in boxes(shape[1:], a % inner, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if b % inner:
        out += [((r1, *o), (1, *s)) for o, s in boxes(shape[1:], 0, b % inner)]
    return out


@dataclass
class Pieces:
    """The boxes of a global tensor of ``shape`` that this rank holds, each with its local tensor
    (a view into the rank's own storage, or a staged copy)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    items: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    load: Callable[[], torch.Tensor] | None = None  # the whole tensor, read only when written

    @classmethod
    def lazy(cls, shape: tuple[int, ...], dtype: torch.dtype,
             load: Callable[[], torch.Tensor]) -> Pieces:
        """One box, the whole tensor, read by ``load()`` when DCP writes it (``fived import``
        streams a model tensor by tensor: the writer resolves one item at a time)."""
        return cls(tuple(shape), dtype, [((0,) * len(shape), torch.empty(shape, device="meta"))],
                   load)

    def add_range(self, flat: torch.Tensor, piece_shape: tuple[int, ...], shift: tuple[int, ...],
                  a: int, b: int) -> None:
        """Elements [a, b) of a piece of shape ``piece_shape`` stored flat in ``flat`` (flat[0]
        is piece element a), the piece sitting at global offset ``shift``."""
        for off, sz in boxes(piece_shape, a, b):
            lo = sum(o * math.prod(piece_shape[i + 1:]) for i, o in enumerate(off))
            n = math.prod(sz)
            glob = tuple(o + s for o, s in zip(off, shift))
            self.items.append((glob, flat[lo - a:lo - a + n].view(sz)))

    def staged(self) -> Pieces:
        """A copy on the CPU (for ``--async-save``: training may change the originals)."""
        return Pieces(self.shape, self.dtype,
                      [(o, t.detach().to("cpu", copy=True)) for o, t in self.items])

    # ---- DCP's protocol (torch.distributed.checkpoint.planner_helpers)
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        out = []
        for off, t in self.items:
            out.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(off), t.size()),
                    properties=TensorProperties(dtype=self.dtype), size=torch.Size(self.shape))))
        return out

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in self.items]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.items:
            if torch.Size(off) == index.offset:
                return self.load().to(self.dtype).contiguous() if self.load else t
        raise ValueError(f"{index.fqn}: no local box at {tuple(index.offset)}")

    def numel(self) -> int:
        return sum(t.numel() for _, t in self.items)

    def size(self) -> torch.Size:  # DCP compares obj.size() with the saved size
        return torch.Size(self.shape)
