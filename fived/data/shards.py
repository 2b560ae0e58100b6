"""A prepared directory opened for reading: each split's tokens as a read-only ``np.memmap``.

``DataDir(path)`` reads ``meta.json`` (``fived.data.meta``) and maps ``train.bin`` / ``val.bin``
lazily; nothing is read from disk until a sequence is sliced out of the map, so every rank of
every layout can open the same directory and touch only the pages of its own sequences.
``identity`` is what a checkpoint records to refuse resuming on other data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .meta import read_meta

OPEN_SHARDS = 2  # shard maps a DataDir keeps open per split


class DataDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.vocab = int(self.meta["vocab"])
        self.eos = int(self.meta["eos"])
        self.dtype = np.dtype(self.meta["dtype"])
        self._maps: dict[str, np.ndarray] = {}

    @property
    def tokenizer_hash(self) -> str:
        return self.meta["tokenizer"]["hash"]

    def identity(self) -> dict[str, Any]:
        return {"dir": str(self.path.resolve()), "tokenizer_hash": self.tokenizer_hash,
                "data_hash": self.meta["data_hash"], "vocab": self.vocab}

    def shards(self, split: str) -> list[dict[str, Any]]:
        """The split's files: [{file, index, tokens, documents}] — one for a directory
        prepared without ``--shard-mb``."""
        info = self.meta["splits"][split]
        if "shards" in info:
            return list(info["shards"])
        return [{"file": info.get("file"), "index": info.get("index"),
                 "tokens": int(info["tokens"]), "documents": int(info.get("documents", 0))}]

    def shard_tokens(self, split: str, j: int) -> np.ndarray:
        """Shard ``j`` of the split, memory-mapped (a sharded split's pages, read on demand).
        At most ``OPEN_SHARDS`` shard maps stay open per split (the most recently used): a
        map holds a file descriptor and keeps the pages it read resident in this process, so
        a loader crossing thousands of shards must not keep them all."""
        key = f"{split}#{j}"
        m = self._maps.pop(key, None)
        if m is None:
            sh = self.shards(split)[j]
            n = int(sh["tokens"])
            m = (np.zeros(0, dtype=self.dtype) if n == 0 else
                 np.memmap(self.path / sh["file"], dtype=self.dtype, mode="r", shape=(n,)))
            mine = [k for k in self._maps if k.startswith(f"{split}#")]
            for old in mine[:max(0, len(mine) - OPEN_SHARDS + 1)]:
                self._maps.pop(old, None)  # the least recently used: its map closes with it
        self._maps[key] = m  # the most recent last
        return m

    def shard_documents(self, split: str, j: int) -> np.ndarray:
        """int64 offsets of shard ``j``'s documents (from 0)."""
        return np.load(self.path / self.shards(split)[j]["index"])

    def tokens(self, split: str) -> np.ndarray:
        """The split's token stream (documents each followed by EOS), memory-mapped (a
        directory prepared without ``--shard-mb``; a sharded one is read by shard)."""
        if "shards" in self.meta["splits"][split]:
            raise ValueError(f"{self.path}: the {split} split is sharded; read it by shard")
        if split not in self._maps:
            info = self.meta["splits"][split]
            n = int(info["tokens"])
            if n == 0:
                self._maps[split] = np.zeros(0, dtype=self.dtype)
            else:
                self._maps[split] = np.memmap(self.path / info["file"], dtype=self.dtype,
                                              mode="r", shape=(n,))
        return self._maps[split]

    def documents(self, split: str) -> np.ndarray:
        """int64 offsets: document d is ``tokens(split)[idx[d]:idx[d + 1]]``."""
        return np.load(self.path / self.meta["splits"][split]["index"])

    def tokenizer(self):
        from . import tokenizer

        f = self.meta["tokenizer"]["file"]
        return tokenizer.ByteTokenizer() if f is None else tokenizer.from_spec((self.path / f).read_text())
