"""ZeRO's parameter all-gather in fp8 against the compute dtype, per recipe, measured.

    python benchmarks/fp8_gather_bytes.py              # small, dp4, bf16, 2 steps, ZeRO 1 2 3
    python benchmarks/fp8_gather_bytes.py --dp 8 --zero 1 2

Each row is a real run (``fived train --model small --precision bf16 --dp N --zero Z --fp8 R``,
with and without ``--no-fp8-gather`` where the fp8 gather applies: ZeRO-3 every recipe, ZeRO-1/2
tensorwise and blockwise; ZeRO-1/2 rowwise keeps the compute-dtype gather) on N gloo ranks of
this CPU: the dense group's bytes one rank sent in its last step (the runtime's counters), then
``fived ledger --check`` of the run (``exact`` when every rank's traffic and model states equal
the ledger's), the ledger's share of those bytes that is the parameter all-gather (its
``params`` and ``updated params`` collectives: the runtime counts by group, the ledger names the
collective; they agree to the byte when the check is exact) and the amax all-reduce, the ratio
of the gather to the same layout's compute-dtype gather, the parameter state one rank holds
(``memory()["params"]``, the largest rank), the largest rank's resident peak (VmHWM) and the
mean CPU step time of the steps after the first (reported, not judged: two shared cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fived.config import ParallelConfig, TrainConfig, preset
from fived.ledger.traffic import micro_batch_size, step_traffic
from fived.ui.report import fmt_b

# (ZeRO stage, recipe, fp8 gather): each recipe's compute-dtype gather first, its ratio's base
LAYOUTS = [(z, r, g) for z in (1, 2) for r in ("tensorwise", "blockwise") for g in (False, True)
           ] + [(3, r, g) for r in ("tensorwise", "rowwise", "blockwise") for g in (False, True)]


def run(dp: int, zero: int, recipe: str, gather: bool, steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fived", "train", "--model", "small", "--precision", "bf16",
           "--dp", str(dp), "--zero", str(zero), "--fp8", recipe, "--steps", str(steps),
           "--metrics-out", str(out)] + ([] if gather else ["--no-fp8-gather"])
    subprocess.run(cmd, check=True, capture_output=True)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    steps_ = [r for r in recs if "step" in r and "traffic" in r]
    check = subprocess.run([sys.executable, "-m", "fived", "ledger", "--check", str(out)],
                           capture_output=True, text=True).stdout
    secs = [r["seconds"] for r in steps_[1:]] or [steps_[0]["seconds"]]
    last = steps_[-1]
    return {"dense": last["traffic"].get("dense", 0.0),
            "exact": "exact: every rank's" in " ".join(check.split()),
            "params": max(r["params"] for r in last["memory_per_rank"]),
            "rss": max(r["peak"] for r in last["rss_per_rank"]),
            "seconds": sum(secs) / len(secs)}


def ledger_parts(dp: int, zero: int, recipe: str, gather: bool, global_batch: int
                 ) -> tuple[float, float]:
    par = ParallelConfig(dp=dp, zero=zero, precision="bf16", fp8=recipe, fp8_gather=gather)
    colls = step_traffic(preset("small"), par, micro_batch_size(par, global_batch))
    dense = [c for c in colls if c.group == "dense" and c.n > 1]
    return (sum(c.bytes for c in dense if c.op == "all_gather"),
            sum(c.bytes for c in dense if "amax" in c.what))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--zero", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    args = ap.parse_args(argv)
    batch = TrainConfig().global_batch  # fived train's default
    print(f"small, bf16, dp{args.dp}, {args.steps} steps; dense bytes one rank sent per step")
    print(f"{'z':>1} {'recipe':<10} {'gather':<6} {'dense':>9} {'all-gather':>10}"
          f" {'amax':>7} {'ratio':>5} {'params':>9} {'RSS':>9} {'check':>5} {'step':>5}")
    base: dict[tuple[int, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for zero, recipe, gather in LAYOUTS:
            if zero not in args.zero:
                continue
            r = run(args.dp, zero, recipe, gather, args.steps,
                    Path(tmp) / f"z{zero}-{recipe}-{gather}.jsonl")
            ag, amax = ledger_parts(args.dp, zero, recipe, gather, batch)
            base.setdefault((zero, recipe), ag)
            ratio = ag / base[(zero, recipe)]
            label = "fp8" if gather else "bf16"
            print(f"{zero:>1} {recipe:<10} {label:<6} {fmt_b(r['dense']):>9}"
                  f" {fmt_b(ag):>10} {fmt_b(amax):>7} {ratio:>5.2f} {fmt_b(r['params']):>9}"
                  f" {fmt_b(r['rss']):>9} {'exact' if r['exact'] else 'NO':>5}"
                  f" {r['seconds']:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
