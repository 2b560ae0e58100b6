"""Part 9, optimizers in a sharded world: bytes and time of every ``--optimizer`` (docs/optimizers.md).

* ``optimizers-layouts``  adamw, adafactor, muon and rownorm each trained on dp2 ZeRO-2, dp2
  ZeRO-3 with row-aligned shards (``--zero-align rows``) and tp2, on 2 spawned gloo ranks: the
  bytes rank 0 sent in the last step (``Traffic``; the table says whether they equal
  ``fived.ledger.traffic.step_bytes`` to the byte, and the optimizer's extra bytes over AdamW's
  collectives) and the median step time.

The runs are ``fived bench numerics optimizers``'s (``fived.bench.numerics.optimizers``), called
and drawn with the bench's own panels. ``fived figures optimizers --out DIR [--quick]`` (quick:
the ``tiny`` model cut to 1 block; full: 2 blocks; 3 steps each).
"""

from __future__ import annotations

from ._fig import Figure, part_main
from .numerics import figure


def figures(quick: bool, tick) -> list[Figure]:
    return [figure("optimizers", quick, tick)]


main = part_main("optimizers", figures, __doc__)
