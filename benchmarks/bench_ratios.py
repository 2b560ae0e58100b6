"""Every ``fived bench`` ratio that has a target, pooled over rounds (docs/benchmarks.md, "The
targets, pooled").

``python benchmarks/bench_ratios.py [--rounds 5] [--only ddp,zero,pp,loop] [--json]``

One round runs, one after the other: ``fived bench ddp --json``, ``fived bench zero --json``,
``fived bench pp --json`` (every schedule) and ``benchmarks/loop_costs.py --nprocs 4 --zero 3
--json`` (``fived train``'s loop against FSDP2), each as a fresh process with its defaults, so a
round is what a reader running the four commands would see. Each bench already alternates fived
and its peer inside the run and reports the paired median (a ratio, never a bare time); this
script runs them ``--rounds`` times and prints, per row, every round's ratio, their median and
range, and the target where the row has one (≤ 1.0 for fived against a torch peer doing the
same work; ≤ 0.65 for the ZeRO-3 loop against FSDP2). The load average before each round is
printed with it: on a shared machine the spread of one row is the measurement's resolution.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# the rows with a target (issue 39): fived against a peer doing the same work. ``bench
# zero``'s ZeRO-1/2 rows run against FSDP2, a ZeRO-3 peer (other work: whole parameters kept,
# a gather after the step), and get no target; they are printed for the record.
TARGETS = {"loop / FSDP2": 0.65, "ddp: fived DDP": 1.0, "zero: fived ZeRO-3": 1.0,
           **{f"{s}: fived": 1.0 for s in ("gpipe", "1f1b", "interleaved", "zb-v", "dualpipe-v")}}
FIVED = [sys.executable, "-m", "fived", "bench"]
COMMANDS = {
    "ddp": FIVED + ["ddp", "--json"],
    "zero": FIVED + ["zero", "--json"],
    "pp": FIVED + ["pp", "--json"],
    "loop": [sys.executable, os.path.join(os.path.dirname(__file__), "loop_costs.py"),
             "--nprocs", "4", "--zero", "3", "--steps", "10", "--json"],
}


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def ratios(name: str, doc: dict) -> dict[str, float]:
    """(row → ratio) of one run: fived's rows against their peers; the loop's single ratio."""
    if name == "loop":  # the ratio of the medians, as docs/benchmarks.md reports it
        return {"loop / FSDP2": doc["loop_s"] / doc["peer_s"]}
    return {f"{r['variant']}: {r['implementation']}": r["ratio"] for r in doc["rows"]
            if not r["peer"] and r["ratio"] is not None and r["implementation"].startswith("fived")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every bench (default 5)")
    ap.add_argument("--only", default="ddp,zero,pp,loop", help="benches to run, comma-separated")
    ap.add_argument("--json", action="store_true", help="print the pooled numbers as JSON last")
    opts = ap.parse_args(argv)
    names = [n for n in opts.only.split(",") if n]
    bad = [n for n in names if n not in COMMANDS]
    if bad:
        ap.error(f"--only: unknown bench {bad[0]!r} (choose from {', '.join(COMMANDS)})")
    pooled: dict[str, dict] = {}
    print(f"{opts.rounds} rounds of: {', '.join(names)}", flush=True)
    for k in range(opts.rounds):
        for name in names:
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            out = subprocess.run(COMMANDS[name], capture_output=True, text=True, check=True)
            got = ratios(name, last_json(out.stdout))
            for row, r in got.items():
                pooled.setdefault(row, {"bench": name, "ratios": [], "loads": []})
                pooled[row]["ratios"].append(r)
                pooled[row]["loads"].append(load)
            print(f"round {k + 1}/{opts.rounds} {name:<4} load {load:4.1f} "
                  f"{time.perf_counter() - t0:5.0f} s: "
                  + ", ".join(f"{row.split(': ')[-1] if name != 'pp' else row.split(':')[0]} "
                              f"{r:.2f}" for row, r in got.items()), flush=True)
    print(f"\n{'row':<34} {'median':>6} {'range':>11} {'target':>6}  met")
    for row, p in pooled.items():
        med, target = statistics.median(p["ratios"]), TARGETS.get(row)
        met = None if target is None else med <= target
        p.update(median=med, target=target, met=met)
        rng = f"{min(p['ratios']):.2f}–{max(p['ratios']):.2f}"
        print(f"{row[:34]:<34} {med:6.2f} {rng:>11} "
              + ("     –     –" if target is None else f"{target:6.2f}  {'yes' if met else 'no'}"))
    if opts.json:
        print(json.dumps(pooled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
