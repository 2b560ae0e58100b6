"""The row dispatch against the token dispatch (``ep_dispatch``): ep bytes, rows per token, time.

Trains one fine-grained MoE (by default 32 experts of width 16, top-8, 4 layers, h 64, the
built-in corpus) at ep4 with each dispatch, with and without node-limited routing (8 groups,
the best 2), STEPS steps each, the runs of one routing alternated (rows, tokens, rows, tokens)
so the shared machine's load falls on both; reads every step's ``--metrics-out`` record:

* ep bytes per rank per step (mean over ranks and steps), measured;
* token rows per token and MoE layer the token dispatch sent (``moe.sent_rows``, counting the
  rows a rank keeps for itself), against ``ep_destinations_bound`` and top-k;
* the ledger's bytes at its bound (``ep_traffic``, uniform routing over the bound);
* tokens / rows: the ratio of the median step times (steps after the first).

    PYTHONPATH=. python benchmarks/ep_dispatch.py [--steps 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROUTINGS = [("free", {}), ("node-limited 2 of 8", dict(route_groups=8, route_top_groups=2))]
EP = 4


def _toml(args, extra: dict) -> str:
    fields = dict(name="qwen3-moe-tiny", experts=args.experts, top_k=args.top_k,
                  moe_ffn=args.moe_ffn, **extra)
    return "[model]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items()) + "\n"


def run(args, extra: dict, mode: str, tmp: Path, tag: str) -> list[dict]:
    cfg, out = tmp / f"{tag}.toml", tmp / f"{tag}.jsonl"
    cfg.write_text(_toml(args, extra))
    cmd = [sys.executable, "-m", "fived", "train", "--config", str(cfg), "--nprocs", str(EP),
           "--ep", str(EP), "--ep-dispatch", mode, "--steps", str(args.steps), "--seed", "3",
           "--metrics-out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def summarise(args, extra: dict, mode: str, records: list[list[dict]]) -> dict:
    from fived.config import ParallelConfig, preset
    from fived.ledger.params import ep_destinations_bound
    from fived.ledger.traffic import bytes_by_group, ep_traffic, micro_batch_size

    m = replace(preset("qwen3-moe-tiny"), experts=args.experts, top_k=args.top_k,
                moe_ffn=args.moe_ffn, **extra)
    par = ParallelConfig(ep=EP, ep_dispatch=mode)
    rows = [r for rec in records for r in rec]
    sent = [sum(r["bytes"].get("ep", 0.0) for r in s["traffic_per_rank"]) / EP for s in rows]
    out = {"ep_bytes": statistics.mean(sent),
           "ledger_bytes": bytes_by_group(ep_traffic(m, par, micro_batch_size(
               par, rows[0]["run"]["global_batch"])))["ep"],
           "step_s": statistics.median(s["seconds"] for rec in records for s in rec[1:]),
           "bound": ep_destinations_bound(m, par)}
    if mode == "tokens":
        per_layer = [sum(lay) for s in rows for r in s["moe"]["sent_rows"] for lay in r
                     if sum(lay)]
        tokens = rows[0]["tokens"] / EP
        out["rows_per_token"] = statistics.mean(per_layer) / tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each dispatch, alternated")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-ffn", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    res: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for name, extra in ROUTINGS:
            recs: dict[str, list] = {"rows": [], "tokens": []}
            for i in range(args.repeats):
                for mode in recs:
                    if not args.json:
                        print(f"{name}: {mode} run {i + 1}/{args.repeats} ...", flush=True)
                    recs[mode].append(run(args, extra, mode, Path(d), f"{len(res)}{mode}{i}"))
            res[name] = {mode: summarise(args, extra, mode, r) for mode, r in recs.items()}
    if args.json:
        print(json.dumps(res))
        return
    print(f"\n{args.experts} experts of {args.moe_ffn}, top-{args.top_k}, ep{EP}, "
          f"{args.steps} steps × {args.repeats}")
    print(f"{'routing':<20} {'dispatch':<8} {'ep MB/rank':>10} {'ledger':>8} "
          f"{'rows/token':>10} {'bound':>5} {'time':>6}")
    for name, r in res.items():
        for mode in ("rows", "tokens"):
            x = r[mode]
            rpt = f"{x['rows_per_token']:.2f}" if mode == "tokens" else f"{args.top_k}"
            ratio = x["step_s"] / r["rows"]["step_s"]
            print(f"{name:<20} {mode:<8} {x['ep_bytes'] / 1e6:10.3f} "
                  f"{x['ledger_bytes'] / 1e6:8.3f} {rpt:>10} {x['bound']:>5} {ratio:5.2f}×")


if __name__ == "__main__":
    main()
