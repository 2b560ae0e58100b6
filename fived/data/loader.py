"""The loader: the global batch of step ``s`` is a pure function of (seed, s, data directory).

Packing. A split's token stream is its documents one after another, each followed by EOS (as
``prepare`` wrote it). With ``L = seq_len`` it is cut into ``n = (N − 1) // L`` windows of
``L + 1`` tokens at stride ``L``: window ``k`` is ``stream[kL : kL + L + 1]``; the model reads
its first ``L`` tokens and predicts its last ``L``. A window may hold the end of one document,
EOS, and the start of the next: documents are packed, never padded.

Order. Training sequence number ``i = s·B + j`` (step ``s``, row ``j`` of the global batch of
``B`` sequences) is window ``perm_e[i mod n]`` of epoch ``e = i // n``, where ``perm_e`` is the
permutation of ``range(n)`` drawn by ``numpy.random.default_rng([seed, e])``. Validation
batches are not shuffled: evaluation batch ``k`` row ``j`` is window ``(k·B + j) mod n``.

The grid. Rows ``[r·B/R, (r+1)·B/R)`` belong to member ``r`` of the batch group (dp·ep, ``R``
members; ``replica``/``replicas``, or ``place(r, R)`` on a loader opened before the layout);
a rank reads only those rows' windows from the memory map, and context parallelism
shards the sequence after (``fived.train.data.shard``, zigzag, as for the built-in
corpus). So every layout trains on the same global batch, and resuming at step ``s`` needs
nothing but ``s``: ``Loader.state`` is the data identity plus the next step.

Prefetch. ``get(step)`` is served by a background thread that reads ``prefetch`` steps ahead
into a bounded queue (numpy releases the GIL while copying from the map); asking for a step
other than the next restarts it there. ``wait_s`` totals the seconds ``get`` waited.
Batches are CPU int64 tensors; ``device`` (e.g. the rank's GPU) receives them with
``non_blocking`` copies (pinned first when the device is CUDA).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from .shards import DataDir
from .vocab import SOURCE_SHIFT


class Loader:
    def __init__(self, data: DataDir | str, split: str, seq_len: int, batch: int, seed: int,
                 replica: int = 0, replicas: int = 1, shuffle: bool = True, prefetch: int = 2,
                 device: torch.device | str | None = None, documents: bool = False):
        self.data = data if isinstance(data, DataDir) else DataDir(data)
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch, seed
        self.shuffle = shuffle
        self.place(replica, replicas, device)
        shards = self.data.shards(split)
        self.sharded = len(shards) > 1
        if self.sharded:  # --shard-mb: windows within each shard (fived.data.loader docstring)
            self.tokens = None
            self.counts = np.asarray([max(0, (int(sh["tokens"]) - 1) // seq_len)
                                      for sh in shards], dtype=np.int64)
            self.base = np.concatenate([[0], np.cumsum(self.counts)])  # shard j's first id
            self.windows = int(self.counts.sum())
            self._shard_perms: dict[tuple[int, int], np.ndarray] = {}
            self._shard_offsets: dict[int, np.ndarray] = {}
            self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        else:
            self.tokens = self.data.tokens(split)
            self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"{split}: {len(self.tokens)} tokens hold no sequence of "
                             f"{seq_len + 1}")
        # --doc-mask: the split's document offsets (already on disk: no pass over the tokens)
        self.documents_on = documents
        self.offsets = (self.data.documents(split) if documents and not self.sharded
                        else None)
        self.prefetch = max(1, prefetch)
        self._perms: dict[int, np.ndarray] = {}
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._q: queue.Queue | None = None
        self._next = -1
        self.wait_s = 0.0

    def place(self, replica: int, replicas: int, device: torch.device | str | None = None
              ) -> Loader:
        """Serve the rows of member ``replica`` of the batch group's ``replicas`` (the global
        batch must divide by it) on ``device``: the layout's one say in what a loader reads."""
        if self.batch_size % replicas:
            raise ValueError(f"global batch {self.batch_size} is not divisible by {replicas} "
                             "replicas")
        self.replica, self.replicas, self.per = replica, replicas, self.batch_size // replicas
        self.device = torch.device(device) if device is not None else None
        return self

    # ------------------------------------------------------------------ the pure function
    def _perm(self, epoch: int) -> np.ndarray:
        p = self._perms.get(epoch)
        if p is None:
            p = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = p
        return p

    def _sharded_window(self, epoch: int, r: int) -> int:
        """Position ``r`` of epoch ``epoch`` in a sharded split: the shards in the order
        ``default_rng([seed, epoch]).permutation(shards)``, each shard's windows in the order
        ``default_rng([seed, epoch, j + 1]).permutation(its windows)`` — a permutation of every
        window, held one shard at a time. Returns the global window id (shard base + local)."""
        order, ends = self._shard_order(epoch)
        t = int(np.searchsorted(ends, r, side="right"))
        j = int(order[t])
        local = r - (int(ends[t - 1]) if t else 0)
        key = (epoch, j)
        p = self._shard_perms.get(key)
        if p is None:
            p = np.random.default_rng([self.seed, epoch, j + 1]).permutation(int(self.counts[j]))
            if len(self._shard_perms) >= 2:
                self._shard_perms.pop(next(iter(self._shard_perms)))
            self._shard_perms[key] = p
        return int(self.base[j]) + int(p[local])

    def _shard_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's shard order and the cumulative windows along it (the last two epochs'
        kept: O(shards) integers each)."""
        got = self._orders.get(epoch)
        if got is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.counts))
            got = (order, np.cumsum(self.counts[order]))
            if len(self._orders) >= 2:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = got
        return got

    def sequence_ids(self, step: int, rows: slice = slice(None)) -> np.ndarray:
        """The window ids of global batch ``step`` (rows ``rows`` of it)."""
        i = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)[rows]
        if not self.shuffle:
            return i % self.windows
        if self.sharded:
            return np.asarray([self._sharded_window(int(x) // self.windows,
                                                    int(x) % self.windows) for x in i],
                              dtype=np.int64)
        out = np.empty_like(i)
        epochs = i // self.windows
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[i[sel] % self.windows]
        return out

    def local_rows(self) -> slice:
        return slice(self.replica * self.per, (self.replica + 1) * self.per)

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
        """(tokens, targets), each (len(ids), seq_len) int64, of the windows ``ids``; with
        ``documents`` also each input token's document number (the index of the document in
        the split, from the ``.idx.npy`` offsets: a document's EOS is its last token)."""
        L = self.seq_len
        seqs = np.empty((len(ids), L + 1), dtype=np.int64)
        if self.sharded:
            return self._read_sharded(ids, seqs)
        for r, k in enumerate(ids.tolist()):
            seqs[r] = self.tokens[k * L:k * L + L + 1]
        t = torch.from_numpy(seqs)
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        if self.offsets is None:
            return x, y
        starts = np.asarray(ids, dtype=np.int64)[:, None] * L + np.arange(L, dtype=np.int64)
        docs = np.searchsorted(self.offsets, starts, side="right") - 1
        return x, y, torch.from_numpy(docs.astype(np.int64))

    def _read_sharded(self, ids: np.ndarray, seqs: np.ndarray) -> tuple[torch.Tensor, ...]:
        L = self.seq_len
        docs = np.empty((len(ids), L), dtype=np.int64) if self.documents_on else None
        for r, g in enumerate(ids.tolist()):
            j = int(np.searchsorted(self.base, g, side="right")) - 1
            k = g - int(self.base[j])
            seqs[r] = self.data.shard_tokens(self.split, j)[k * L:k * L + L + 1]
            if docs is not None:
                offs = self._shard_offsets.get(j)
                if offs is None:
                    offs = self.data.shard_documents(self.split, j)
                    if len(self._shard_offsets) >= 2:
                        self._shard_offsets.pop(next(iter(self._shard_offsets)))
                    self._shard_offsets[j] = offs
                docs[r] = np.searchsorted(offs, k * L + np.arange(L), side="right") - 1
        t = torch.from_numpy(seqs)
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        return (x, y) if docs is None else (x, y, torch.from_numpy(docs))

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(self.sequence_ids(step))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's rows of global batch ``step`` (read now, on this thread)."""
        return self.read(self.sequence_ids(step, self.local_rows()))

    # ------------------------------------------------------------------ prefetch
    def get(self, step: int) -> tuple[torch.Tensor, ...]:
        """``batch(step)`` from the prefetch thread, on ``device``."""
        if self._thread is None or step != self._next:
            self._start(step)
        assert self._q is not None
        t0 = time.perf_counter()
        s, item = self._q.get()
        self.wait_s += time.perf_counter() - t0
        assert s == step, (s, step)
        self._next = step + 1
        if isinstance(item, BaseException):
            raise item
        if self.device is not None and self.device.type != "cpu":
            item = tuple(t.to(self.device, non_blocking=True) for t in item)
        return item

    def _start(self, step: int) -> None:
        self.close()
        self._stop, self._q = threading.Event(), queue.Queue(self.prefetch)
        self._thread = threading.Thread(target=self._run, args=(step, self._stop, self._q),
                                        name=f"fived-loader-{self.split}", daemon=True)
        self._thread.start()

    def _run(self, step: int, stop: threading.Event, q: queue.Queue) -> None:
        pin = self.device is not None and self.device.type == "cuda"
        while not stop.is_set():
            try:
                item: Any = self.batch(step)
                if pin:
                    item = tuple(t.pin_memory() for t in item)
            except BaseException as e:  # handed to get(), which raises it
                item = e
            while not stop.is_set():
                try:
                    q.put((step, item), timeout=0.1)
                    break
                except queue.Full:
                    continue
            step += 1

    def close(self) -> None:
        if self._thread is not None:
            assert self._stop is not None
            self._stop.set()
            self._thread.join()
        self._thread, self._stop, self._q, self._next = None, None, None, -1

    # ------------------------------------------------------------------ resume
    def state(self, next_step: int) -> dict[str, Any]:
        return {"source": "data", **self.data.identity(), "split": self.split,
                "seed": self.seed, "global_batch": self.batch_size, "seq_len": self.seq_len,
                "next_step": next_step}


MIX_STREAM = 0x6D6978  # "mix": the source draw's own stream of (seed, step)


class MixtureLoader(Loader):
    """``--data code=DIR1:0.3,web=DIR2:0.7``: each row of global batch ``step`` comes from one
    source, drawn by weight from ``numpy.random.default_rng([seed, step, MIX_STREAM])`` (the
    whole batch's B draws at once, so every rank sees the same draw); the row's window is the
    one the source's own loader (seed ``seed + 1_000_003·(k+1)``) gives global sequence number
    ``step·B + j`` — its windows in its own shuffled order, the numbers other sources took
    skipped. So the batch is a pure function of (seed, step, the sources and weights): resuming
    at a step, or under another layout, sees the same rows. Validation batch ``k`` draws from
    ``[seed, k, 1, MIX_STREAM]`` and reads unshuffled windows."""

    def __init__(self, sources, split: str, seq_len: int, batch: int, seed: int,
                 replica: int = 0, replicas: int = 1, shuffle: bool = True, prefetch: int = 2,
                 device=None, documents: bool = False):
        from .shards import DataDir

        self.sources = list(sources)
        self.parts = [Loader(DataDir(src.path), split, seq_len, batch,
                             seed + 1_000_003 * (k + 1), replica, replicas, shuffle, prefetch,
                             None, documents) for k, src in enumerate(self.sources)]
        w = np.asarray([src.weight for src in self.sources], dtype=np.float64)
        self.p = w / w.sum()
        self.data = self.parts[0].data
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch, seed
        self.shuffle = shuffle
        self.place(replica, replicas, device)
        self.offsets = self.parts[0].offsets
        self.prefetch = max(1, prefetch)
        self._thread = self._stop = self._q = None
        self._next = -1
        self.wait_s = 0.0

    def place(self, replica: int, replicas: int, device: torch.device | str | None = None
              ) -> MixtureLoader:
        """``Loader.place``, and each source's loader on the same rows (on the CPU: the
        mixture moves the merged rows)."""
        for part in self.parts:
            part.place(replica, replicas)
        super().place(replica, replicas, device)
        return self

    def row_sources(self, step: int) -> np.ndarray:
        """The source index of every row of global batch ``step``."""
        key = [self.seed, step, MIX_STREAM] if self.shuffle else [self.seed, step, 1, MIX_STREAM]
        return np.random.default_rng(key).choice(len(self.parts), size=self.batch_size,
                                                 p=self.p)

    def _rows(self, step: int, rows: slice) -> tuple[torch.Tensor, ...]:
        src = self.row_sources(step)[rows]
        out = None
        for k, part in enumerate(self.parts):
            sel = np.nonzero(src == k)[0]
            if not len(sel):
                continue
            got = list(part.read(part.sequence_ids(step, rows)[sel]))
            got[1] = got[1] + (k << SOURCE_SHIFT)  # the row's source rides on its targets
            if out is None:
                out = [torch.empty((len(src), *t.shape[1:]), dtype=t.dtype) for t in got]
            for o, t in zip(out, got):
                o[torch.from_numpy(sel)] = t
        assert out is not None
        return tuple(out)

    def global_batch(self, step: int) -> tuple[torch.Tensor, ...]:
        return self._rows(step, slice(None))

    def batch(self, step: int) -> tuple[torch.Tensor, ...]:
        return self._rows(step, self.local_rows())

    def state(self, next_step: int) -> dict[str, Any]:
        import hashlib

        ident = [p.data.identity() for p in self.parts]
        h = hashlib.sha256(repr([(s.name, i["data_hash"], s.weight)
                                 for s, i in zip(self.sources, ident)]).encode()).hexdigest()
        return {"source": "mixture", "dir": ",".join(i["dir"] for i in ident),
                "tokenizer_hash": ident[0]["tokenizer_hash"], "data_hash": h,
                "vocab": ident[0]["vocab"], "split": self.split, "seed": self.seed,
                "global_batch": self.batch_size, "seq_len": self.seq_len,
                "next_step": next_step,
                "sources": [{"name": s.name, "weight": s.weight} for s in self.sources]}


def open_loader(spec: str, split: str, **kw: Any) -> Loader:
    """A ``Loader`` of a prepared directory, or a ``MixtureLoader`` of a mixture spec."""
    from .meta import parse_mixture

    sources = parse_mixture(spec)
    if sources is None:
        return Loader(spec, split, **kw)
    return MixtureLoader(sources, split, **kw)
