"""The built-in corpus and the layout-independent batch.

The corpus is this Python's own standard library source (``*.py`` under ``sysconfig``'s stdlib
path, sorted, concatenated up to ``corpus_mb``) read as bytes: a 256-symbol byte-level
vocabulary, no tokenizer, no download. It is the same on every rank of one machine.

Step ``s`` of a run with seed ``seed`` draws ``global_batch`` start offsets from a generator
seeded by (seed, s); sequence j is ``corpus[o_j : o_j + seq_len]`` with targets shifted by one.
The batch group (dp·ep ranks) splits those sequences into equal contiguous slices, and each
slice into micro-batches — so every layout trains on exactly the same tokens.
"""

from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def corpus_bytes(megabytes: float = 4.0) -> bytes:
    limit = int(megabytes * 2**20)
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out.append(data)
        total += len(data)
        if total >= limit:
            break
    blob = b"".join(out)[:limit]
    if len(blob) < 1 << 16:
        raise RuntimeError(f"built-in corpus too small ({len(blob)} bytes under {root})")
    return blob


@lru_cache(maxsize=4)
def corpus_tensor(megabytes: float = 4.0) -> torch.Tensor:
    return torch.frombuffer(bytearray(corpus_bytes(megabytes)), dtype=torch.uint8).long()


def global_batch(step: int, seed: int, batch: int, seq_len: int, megabytes: float = 4.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (batch, seq_len) int64, for optimizer step ``step``."""
    data = corpus_tensor(megabytes)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    seqs = data[idx]
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def local_batch(step: int, seed: int, batch: int, seq_len: int, replica: int, replicas: int,
                megabytes: float = 4.0) -> tuple[torch.Tensor, torch.Tensor]:
    """This batch-group member's contiguous slice of the global batch."""
    x, y = global_batch(step, seed, batch, seq_len, megabytes)
    per = batch // replicas
    return x[replica * per:(replica + 1) * per], y[replica * per:(replica + 1) * per]

