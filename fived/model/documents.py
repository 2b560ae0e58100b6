"""Document masks: each token attends only to earlier tokens of its own document.

A packed window (``fived.data.loader``) may hold the end of one document, its EOS, and the
start of the next. With ``--doc-mask`` the loader yields, with each window, the document id
of every token (``docs``, (b, S) int64, from the split's ``.idx.npy`` offsets: the EOS is the
last token of its document, as torchtitan's ``get_document_mask_mod_using_eos_id`` assigns it).

``Documents(positions, docs)`` travels where the RoPE ``positions`` travel (the trainer, the
pipeline executor, ``Transformer.forward``): ``positions`` are this rank's tokens' RoPE
positions per row (b, s_local) — the window positions (``--doc-positions continue``) or the
positions inside each document (``reset``) — and ``docs`` the ids of the *whole* row (b, S),
unsharded, so that a context-parallel rank knows the documents of every K/V chunk that
reaches it. ``Transformer.forward`` hands ``docs`` to every attention core as the third item
of the rope tuple (so activation recompute reruns the core with the same ids).

The one-rank core (``doc_attention``) is per-document varlen: each (row, document) segment
runs the fused causal SDPA kernel on its own tokens, so no cross-document block is computed
at all — the work is Σ Lᵢ² instead of S² (docs/context-parallel.md measures it against SDPA
with a boolean mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Documents:
    """RoPE positions (b, s_local) and document ids (b, S) of one batch (or micro-batch)."""

    positions: torch.Tensor
    docs: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> Documents:
        return Documents(self.positions.to(device, non_blocking=non_blocking),
                         self.docs.to(device, non_blocking=non_blocking))

    def chunk(self, m: int) -> list[Documents]:
        return [Documents(p, d) for p, d in zip(self.positions.chunk(m), self.docs.chunk(m))]

    @property
    def shape(self) -> torch.Size:  # what a caller that logs a positions tensor's shape sees
        return self.positions.shape


def micro_positions(positions, m: int) -> list:
    """The positions of each of ``m`` micro-batches: a shared (s,) tensor m times, or the
    per-row ``Documents`` cut like the batch."""
    if isinstance(positions, Documents):
        return positions.chunk(m)
    return [positions] * m


def unpack(positions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RoPE positions, document ids or None)."""
    if isinstance(positions, Documents):
        return positions.positions, positions.docs
    return positions, None


def reset_positions(docs: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document (within the window), (b, S) int64."""
    s = docs.shape[-1]
    idx = torch.arange(s, device=docs.device).expand_as(docs)
    start = torch.ones_like(docs, dtype=torch.bool)
    start[..., 1:] = docs[..., 1:] != docs[..., :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - first


def segments(docs_row: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)) of the documents of one row (ids constant along each segment)."""
    _, counts = torch.unique_consecutive(docs_row, return_counts=True)
    out, a = [], 0
    for n in counts.tolist():
        out.append((a, a + n))
        a += n
    return out


def row_segments(docs: torch.Tensor) -> list[list[tuple[int, int]]]:
    """``segments`` of every row of ``docs`` (b, S): the one place the varlen core reads the
    ids' values (the dry run computes it from the ids it holds on the host)."""
    return [segments(docs[r]) for r in range(docs.shape[0])]


def doc_mask(qpos: torch.Tensor, kpos: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """(b, len(qpos), len(kpos)) bool: query at global position qpos may see key at kpos
    (same document, not later)."""
    same = docs[:, qpos][:, :, None] == docs[:, kpos][:, None, :]
    return same & (qpos[:, None] >= kpos[None, :])[None]
