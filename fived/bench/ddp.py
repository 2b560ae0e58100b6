"""``fived bench ddp``: fived's DDP engine against PyTorch's ``DistributedDataParallel``.

Same model (the reference Llama-style decoder), same ranks, same data, in one run; the variants
alternate inside every repetition (the order flips each time) and each repetition times
``--steps`` optimizer steps after a warm-up; the table shows medians over ``--reps``.

Columns: step time and its ratio to the PyTorch peer, model-state bytes per rank (params +
grads + master + optimizer, from the tensors held), and for fived the fraction of
communication hidden by overlap::

    hidden = 1 − (comm wait with overlap) / (comm wait with --no-overlap)

(the no-overlap run waits for every byte after backward, so its wait is the whole
communication time; with overlap only the part backward did not cover remains).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import harness
from .harness import Runner, fived_runner, hidden_fraction, torch_ddp_runner


def ddp_runners(cfg: Any, par: Any, train: Any, args: Any, rank: int, world: int,
                batch: Callable) -> list[Runner]:
    return [fived_runner("fived DDP", cfg, par, train, rank, world, batch),
            fived_runner("fived DDP no-overlap", cfg, replace(par, overlap=False), train, rank,
                         world, batch),
            torch_ddp_runner(cfg, train, args.bucket_mb, world, batch)]


def hidden_for(rows: list[dict]) -> dict[str, float | None]:
    return {"fived DDP": hidden_fraction(rows, "fived DDP", "fived DDP no-overlap")}


def main(argv: list[str] | None = None) -> int:
    return harness.main(sys.argv[1:] if argv is None else argv, "ddp", ddp_runners, hidden_for,
                        "torch DDP", "fived DDP vs torch DistributedDataParallel",
                        __doc__.splitlines()[0])
