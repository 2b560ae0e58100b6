"""The trainer's data: the built-in corpus and the layout-independent batch; ``--data``'s
loaders; a rank's columns of its rows; a mixture's loss per source.

The corpus is this Python's own standard library source (``*.py`` under ``sysconfig``'s stdlib
path, sorted, concatenated up to ``corpus_mb``) read as bytes: a 256-symbol byte-level
vocabulary, no tokenizer, no download. It is the same on every rank of one machine.

Step ``s`` of a run with seed ``seed`` draws ``global_batch`` start offsets from a generator
seeded by (seed, s); sequence j is ``corpus[o_j : o_j + seq_len]`` with targets shifted by one.
The batch group (dp·ep ranks) splits those sequences into equal contiguous slices, and each
slice into micro-batches — so every layout trains on exactly the same tokens.

With ``--data`` the loaders of ``fived.data.loader`` serve the rows instead (``open_loaders``,
layout-free; the trainer then ``place``s each on its batch-group rows). ``shard`` cuts a rank's
rows along the sequence for context parallelism (zigzag, or per row under ``--cp-balance
ptrr``: ``fived.parallel.cp_balance``) and gives their RoPE positions — a ``Documents`` (per
row positions and document ids) under ``--doc-mask``.
"""

from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..comm import ops
from ..config import ConfigError
from ..data.vocab import mark_eos_targets
from ..model.documents import Documents, reset_positions
from ..parallel.cp_balance import balanced_positions


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


def open_loaders(train: Any, model_cfg: Any, eval_split: str = "") -> tuple[Any, Any, dict]:
    """``--data``, before any layout: (the training loader, the validation loader of
    ``--eval-every``, a mixture's sources' own validation loaders by name); with
    ``eval_split`` (``fived eval``) only that split's loader (not shuffled) and its sources'.
    (None, None, {}) without ``--data``. A ConfigError when the tokenizer has more symbols
    than the model's vocabulary."""
    if not train.data:
        return None, None, {}
    from ..data.loader import open_loader

    kw = dict(seq_len=model_cfg.seq_len, batch=train.global_batch, seed=train.seed,
              documents=train.doc_mask)
    loader = None
    if eval_split:
        evals = open_loader(train.data, eval_split, shuffle=False, prefetch=train.prefetch,
                            **kw)
    else:
        loader = open_loader(train.data, "train", prefetch=train.prefetch, **kw)
        evals = (open_loader(train.data, "val", shuffle=False, **kw) if train.eval_every
                 else None)
    by_source = {src.name: open_loader(src.path, part.split, shuffle=False, **kw)
                 for src, part in zip(getattr(evals, "sources", []),
                                      getattr(evals, "parts", []))}
    data = (loader if loader is not None else evals).data
    if data.vocab > model_cfg.vocab:
        raise ConfigError([f"--data {train.data}: the tokenizer has {data.vocab} symbols but "
                           f"the model's vocab is {model_cfg.vocab}"])
    return loader, evals, by_source


def shard(x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None = None, *, cp: Any,
          zigzag: torch.Tensor | None, balance: str, doc_positions: str, device: Any,
          eos_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A rank's columns of its batch rows and their positions, on ``device``: with cp > 1 the
    zigzag shard (``zigzag``: its global positions), or each row's own ``ptrr`` blocks
    (``balance``, with document ids); with document ids (--doc-mask) the positions are a
    ``Documents`` (the shard's per-row RoPE positions — from 0 in each document under
    ``doc_positions="reset"`` — and the whole rows' ids: ``fived.model.documents``)."""
    seq_len = x.shape[1]
    positions = torch.arange(seq_len)
    if eos_id is not None:  # --eos-target ignore: the EOS tokens' targets marked
        y = mark_eos_targets(x, y, eos_id)
    ptrr = (balanced_positions(docs, cp.size, cp.rank)
            if docs is not None and cp.size > 1 and balance == "ptrr" else None)
    rows = None
    if docs is not None:
        rows = (reset_positions(docs) if doc_positions == "reset"
                else torch.arange(seq_len).expand_as(docs))
    if ptrr is not None:
        x, y, rows = x.gather(1, ptrr), y.gather(1, ptrr), rows.gather(1, ptrr)
    elif cp.size > 1:
        positions = zigzag
        x, y = x[:, positions].contiguous(), y[:, positions].contiguous()
        rows = None if rows is None else rows[:, positions.to(rows.device)]
    if docs is not None:
        positions = Documents(rows.contiguous(), docs)
    return x.to(device), y.to(device), positions.to(device)


class SourceLosses:
    """A mixture's step loss per source (mean CE over the source's rows' tokens; None for a
    source no row came from), as two step hooks: ``before_step`` clears the loss modules'
    tallies (``fived.data.vocab.SourceLoss``), ``record`` sums them as the loss is summed
    (÷ tp, then over dense, tp and pp: one more metrics all-reduce of K values) and adds
    ``loss_by_source`` to the step's record."""

    def __init__(self, loader: Any, tallies: list[Any], loss_groups: list[Any], tp: int,
                 seq_len: int, device: Any):
        self.loader, self.tallies, self.loss_groups = loader, tallies, loss_groups
        self.tp, self.seq_len, self.device = tp, seq_len, device

    def before_step(self, scale: float) -> None:
        for t in self.tallies:
            t.reset()

    def record(self, rec: dict[str, Any], seconds: float) -> None:
        names = [s.name for s in self.loader.sources]
        t = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for sl in self.tallies:
            for k, v in enumerate(sl.tally):
                if v is not None:
                    t[k] += v.double()
        t /= self.tp
        for group in self.loss_groups:  # as the loss: over dense, tp, then pp
            ops.all_reduce(t, group)
        rows = np.bincount(self.loader.row_sources(rec["step"]), minlength=len(names))
        rec["loss_by_source"] = {
            n: (float(t[k]) / (int(rows[k]) * self.seq_len) if rows[k] else None)
            for k, n in enumerate(names)}
