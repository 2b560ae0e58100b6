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
members); a rank reads only those rows' windows from the memory map, and context parallelism
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


class Loader:
    def __init__(self, data: DataDir | str, split: str, seq_len: int, batch: int, seed: int,
                 replica: int = 0, replicas: int = 1, shuffle: bool = True, prefetch: int = 2,
                 device: torch.device | str | None = None):
        self.data = data if isinstance(data, DataDir) else DataDir(data)
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch, seed
        self.replica, self.replicas, self.shuffle = replica, replicas, shuffle
        if batch % replicas:
            raise ValueError(f"global batch {batch} is not divisible by {replicas} replicas")
        self.per = batch // replicas
        self.tokens = self.data.tokens(split)
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"{split}: {len(self.tokens)} tokens hold no sequence of "
                             f"{seq_len + 1}")
        self.prefetch = max(1, prefetch)
        self.device = torch.device(device) if device is not None else None
        self._perms: dict[int, np.ndarray] = {}
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._q: queue.Queue | None = None
        self._next = -1
        self.wait_s = 0.0

    # ------------------------------------------------------------------ the pure function
    def _perm(self, epoch: int) -> np.ndarray:
        p = self._perms.get(epoch)
        if p is None:
            p = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = p
        return p

    def sequence_ids(self, step: int, rows: slice = slice(None)) -> np.ndarray:
        """The window ids of global batch ``step`` (rows ``rows`` of it)."""
        i = step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)[rows]
        if not self.shuffle:
            return i % self.windows
        out = np.empty_like(i)
        epochs = i // self.windows
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[i[sel] % self.windows]
        return out

    def local_rows(self) -> slice:
        return slice(self.replica * self.per, (self.replica + 1) * self.per)

    def read(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each (len(ids), seq_len) int64, of the windows ``ids``."""
        L = self.seq_len
        seqs = np.empty((len(ids), L + 1), dtype=np.int64)
        for r, k in enumerate(ids.tolist()):
            seqs[r] = self.tokens[k * L:k * L + L + 1]
        t = torch.from_numpy(seqs)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(self.sequence_ids(step))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's rows of global batch ``step`` (read now, on this thread)."""
        return self.read(self.sequence_ids(step, self.local_rows()))

    # ------------------------------------------------------------------ prefetch
    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
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
        x, y = item
        if self.device is not None and self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y

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
