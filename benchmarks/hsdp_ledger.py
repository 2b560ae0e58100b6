"""Hybrid sharding in the ledger: predicted step time and largest-rank memory of one layout as
flat ZeRO-3, hybrid ZeRO-3 at several shard degrees, and plain DDP (issue 42's anchors).

    python benchmarks/hsdp_ledger.py                  # both anchors below
    python benchmarks/hsdp_ledger.py llama3-70b       # one

Each row is ``fived.ledger.planner.predict`` (what ``fived ledger`` prints) on H100 SXM, 8 per
node: the model states (÷ N, not dp), the largest rank's peak (``RankMemory.peak``) and
whether it fits 72 GB usable (0.9 of 80 GB), the exposed ZeRO and data-parallel time, the step time and MFU.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from fived.config import ParallelConfig, preset
from fived.ledger.hardware import get as preset_hardware
from fived.ledger.planner import predict

ANCHORS = {
    # Llama 3 70B on 256 H100s: `fived plan --model llama3-70b --gpus 256 --gpu h100-sxm`'s
    # winner, tp2·cp2·dp64·zero3·sp·b1 (global batch 64)
    "llama3-70b": (256, 64, ParallelConfig(tp=2, cp=2, dp=64, micro_batches=1,
                                           sequence_parallel=True, precision="bf16"),
                   (16, 4, 2)),
    # Llama 3 405B on 8,192 H100s: `fived plan --model llama3-405b --gpus 8192 --global-batch
    # 2048 --precision bf16`'s winner, tp4·cp2·pp16·dp64·v4·zero3·sp·b1·rc-full
    "llama3-405b": (8192, 2048, ParallelConfig(tp=4, cp=2, pp=16, dp=64, micro_batches=32,
                                               sequence_parallel=True, precision="bf16",
                                               schedule="interleaved", virtual_stages=4,
                                               recompute="full"),
                    (8, 2, 1)),
}


def rows(name: str) -> list[tuple[str, float, float, bool, float, float, float]]:
    gpus, batch, base, shards = ANCHORS[name]
    m = preset(name)
    hw = preset_hardware("h100-sxm")
    out = []
    for label, par in ([("flat ZeRO-3", replace(base, zero=3))]
                       + [(f"ZeRO-3 dp-shard {n}", replace(base, zero=3, dp_shard=n))
                          for n in shards]
                       + [("DDP (ZeRO-0)", replace(base, zero=0))]):
        p = predict(m, par, hw, batch, 8)
        out.append((label, p.memory.states_total / 1e9, p.memory.peak / 1e9, p.fits,
                    p.times["zero_per_micro"] + p.times["dp"], p.step_seconds, p.mfu))
    return out


def main(argv: list[str]) -> int:
    for name in argv or list(ANCHORS):
        gpus, batch, base, _ = ANCHORS[name]
        print(f"{name} on {gpus} H100 SXM (8 per node), {base.describe()}, global batch {batch}")
        print(f"  {'layout':<22}{'states GB':>10}{'peak GB':>10}{'fits':>6}{'dp+zero s':>11}"
              f"{'step s':>9}{'MFU':>7}")
        for label, st, peak, fits, dp, step, mfu in rows(name):
            print(f"  {label:<22}{st:>10.2f}{peak:>10.2f}{'yes' if fits else 'no':>6}{dp:>11.3f}"
                  f"{step:>9.3f}{mfu:>7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
