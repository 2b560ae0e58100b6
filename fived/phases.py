"""Where the step is: the runtime names each phase of a step as it enters it, and whoever
listens (the memory trace, ``fived.train.memtrace``) hears the name.

The names are the ledger's (``fived.ledger.peak``): ``build``, ``F mb s`` and ``B mb s`` / ``W mb
s`` for each compute action of the pipeline schedule (micro-batch ``mb`` of stage ``s``; without
pp the stage is 0), ``reduce`` (the engine's last gradient reductions), ``clip``, ``optimizer``
and ``end``. With no listener (the default) ``enter`` costs one truth test of an empty list.
"""

from __future__ import annotations

from collections.abc import Callable

LISTENERS: list[Callable[[str], None]] = []


def enter(name: str) -> None:
    for f in LISTENERS:
        f(name)


def compute(kind: str, mb: int, stage: int) -> None:
    """A compute action of the schedule: ``F``, ``B`` or ``W`` of micro-batch ``mb``, stage."""
    if LISTENERS:
        enter(f"{kind} {mb} {stage}")
