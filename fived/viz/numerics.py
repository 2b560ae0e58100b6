"""Part 8, numerics: what bf16 and fp16 lose, and why 12 of the 16Ψ stay fp32 (docs/numerics.md).

* ``numerics-masters``  bf16 parameters stepped with an fp32 master, in place (round to
  nearest), with stochastic rounding and with Kahan compensation: the loss against the
  fp32-master run and, per step, the fraction of the optimizer's updates that did not move the
  stored value;
* ``numerics-moments``  AdamW's m and v stored in fp32, bf16, fp16: the loss against fp32
  moments and the moment updates storage lost (v underflow in the table);
* ``numerics-reduce``   the model's real per-shard gradients summed in ring order in bf16 and
  fp32 (each hop rounds), against the float64 sum, as dp grows;
* ``numerics-fp16``     fp16 with dynamic loss scaling started too high (2²⁴): the scale, the
  skipped steps, and the gradient elements flushed to 0 / left subnormal;
* ``numerics-fp8``      bf16 against each fp8 recipe (tensorwise, rowwise, blockwise) from one
  seed: the loss gap per step; and one fp8 product with an outlier channel: the error of the
  other channels as the outlier grows (fp8: ``small`` with its 8 blocks for 300 steps in full,
  per-layer statistics every 50 steps; quick: ``tiny`` with 1 block, 3 steps).

Every number is measured by the experiment functions of ``fived bench numerics`` (one process,
the ``tiny`` model cut to a few blocks; fp8 in full: ``small`` whole), which this module calls
and draws with the bench's own panels. ``fived figures numerics --out DIR [--quick]`` (quick:
1 block, 3–6 steps; full: 2 blocks, the steps of docs/numerics.md: masters 20, moments 30, fp16
20, fp8 300). The reduce experiment is one gradient (no steps).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from ._fig import Figure, part_main

LR = 1e-3
NAMES = {"optimizers": "optimizers-layouts"}  # the figure's file stem (PART-what)
TITLES = {
    "masters": "bf16 parameters: fp32 master vs in place, stochastic rounding, Kahan",
    "moments": "AdamW's m and v stored in fp32, bf16, fp16",
    "reduce": "Summing dp gradient shards in bf16 vs fp32 (ring order)",
    "fp16": "fp16 with dynamic loss scaling (started at 2²⁴)",
    "optimizers": "Every --optimizer on dp2 ZeRO-2, dp2 ZeRO-3 row-aligned, tp2",
    "fp8": "fp8 linear layers: the loss against bf16, and an outlier channel per recipe",
}
HOW = {
    "masters": "fived.bench.numerics.masters: one rank, --precision bf16 with each "
               "--master-weights; the engine's rounding counters per step",
    "moments": "fived.bench.numerics.moments: one rank, fp32 parameters, AdamW with m, v rounded "
               "to the dtype on store (CountingAdamW); what storage lost, counted per step",
    "reduce": "fived.bench.numerics.reduce: the model's fp32 gradient of each of dp shards of a "
              "16-sequence batch, summed in ring order rounding after every hop, against float64",
    "fp16": "fived.bench.numerics.fp16: one rank, --precision fp16, the scaler's scale and the "
            "fp16 gradient buffers counted before each step's skip / apply",
    "fp8": "fived.bench.numerics.fp8: one rank, --precision bf16 with each --fp8 recipe from "
           "one seed; the outlier panel is one fp8 product x·Wᵀ with channel 3 of x scaled",
    "optimizers": "fived.bench.numerics.optimizers: 2 spawned gloo ranks; Traffic's bytes of the "
                  "last step beside fived.ledger.traffic.step_bytes, median step time",
}


def settings(name: str, quick: bool) -> dict[str, Any]:
    """The arguments ``fived bench numerics NAME`` takes (``--steps --lr --layers``)."""
    steps = {"masters": (4, 20), "moments": (4, 30), "reduce": (1, 1), "fp16": (6, 20),
             "optimizers": (3, 12), "fp8": (3, 300)}[name][0 if quick else 1]
    s: dict[str, Any] = {"steps": steps, "lr": LR, "layers": 1 if quick else 2}
    if name == "fp8":  # the built-in corpus (this Python's standard library); small whole
        s.update(model="tiny" if quick else "small", layers=1 if quick else 0, data="",
                 stats_every=50)
    return s


def measure(name: str, quick: bool, tick) -> dict[str, Any]:
    """Run the bench's experiment; its settings, the model it cut, and every number it returned."""
    from ..bench import numerics as numerics_bench

    s = settings(name, quick)
    tick(f"{part_of(name)}: {name} ({s['layers'] or 'all'} block(s), {s['steps']} steps)")
    res = numerics_bench.RUN[name][0](argparse.Namespace(**s), say=tick)
    d = {"settings": s, "model": asdict(numerics_bench.model_cfg(s["layers"])),
         "bench": f"fived bench numerics {name} --steps {s['steps']} --lr {s['lr']:g} "
                  f"--layers {s['layers']}", "result": res}
    if name == "fp8":
        d["model"] = asdict(numerics_bench.fp8_model(argparse.Namespace(**s)))
        d["bench"] += f" --model {s['model']} --stats-every {s['stats_every']}"
    if name == "optimizers":  # each layout's ParallelConfig, so the ledger can be asked again
        d["layouts"] = {k: asdict(p) for k, p in numerics_bench.LAYOUTS.items()}
    return d


def part_of(name: str) -> str:
    return "optimizers" if name == "optimizers" else "numerics"


def figure(name: str, quick: bool, tick) -> Figure:
    from ..bench import numerics as numerics_bench

    d = measure(name, quick, tick)
    part = part_of(name)
    table = [numerics_bench.HEADERS[name], *numerics_bench.RUN[name][1](d["result"])]
    return Figure(NAMES.get(name, f"numerics-{name}"), TITLES[name],
                  part, "ledger+run" if name == "optimizers" else "run", HOW[name], d,
                  lambda data, f: numerics_bench.draw(name, data["result"], f),
                  size=(12.0, 3.4) if name == "fp8" else (9.0, 3.4),
                  table=table)


def figures(quick: bool, tick) -> list[Figure]:
    return [figure(n, quick, tick) for n in ("masters", "moments", "reduce", "fp16", "fp8")]


main = part_main("numerics", figures, __doc__)
