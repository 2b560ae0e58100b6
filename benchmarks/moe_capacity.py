"""Tokens per expert and the dropped share under capacity vs dropless (issue 29's measure).

Trains one fine-grained MoE (by default 32 experts of width 16, top-8, 4 layers, h 64) with
each routing setting for STEPS steps at ep2 on the built-in corpus, the same seed and data,
and reads each step's MoE statistics from ``--metrics-out``:

* dropped share = dropped assignments / (tokens · top_k · MoE layers), over the whole run;
* load imbalance = max / mean tokens per expert, per layer, in the last step (1.0: even);
* the final loss.

    PYTHONPATH=. python benchmarks/moe_capacity.py [--steps 40] [--experts 32] [--top-k 8]

Settings: dropless (capacity_factor 0), capacity 1.0, 1.25, 2.0 (all with the balance loss),
dropless with no balancing at all (aux_loss_coef 0) for contrast, and dropless with loss-free
balancing alone (balance = "bias", γ = 0.003, no balance loss).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = [
    ("dropless, aux loss", dict(capacity_factor=0.0)),
    ("capacity 1.0", dict(capacity_factor=1.0)),
    ("capacity 1.25", dict(capacity_factor=1.25)),
    ("capacity 2.0", dict(capacity_factor=2.0)),
    ("dropless, no balancing", dict(capacity_factor=0.0, aux_loss_coef=0.0)),
    ("dropless, loss-free bias", dict(capacity_factor=0.0, aux_loss_coef=0.0, balance="bias",
                                      bias_update_rate=0.003)),
]


def _toml(args, extra: dict) -> str:
    fields = dict(name="qwen3-moe-tiny", experts=args.experts, top_k=args.top_k,
                  moe_ffn=args.moe_ffn, **extra)
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items())
    return f"[model]\n{body}\n"


def run(args, extra: dict, tmp: Path, tag: str) -> dict:
    cfg, out = tmp / f"{tag}.toml", tmp / f"{tag}.jsonl"
    cfg.write_text(_toml(args, extra))
    cmd = [sys.executable, "-m", "fived", "train", "--config", str(cfg), "--nprocs", "2",
           "--ep", "2", "--steps", str(args.steps), "--seed", "3", "--metrics-out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(r["tokens"] for r in rows)
    dropped = sum(r["moe"]["dropped"] for r in rows)
    last = rows[-1]["moe"]["tokens_per_expert"]
    imb = [max(layer) / (sum(layer) / len(layer)) for layer in last if sum(layer)]
    return {"dropped_share": dropped / (tokens * args.top_k * len(last)),
            "imbalance_max": max(imb), "imbalance_mean": sum(imb) / len(imb),
            "loss": rows[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-ffn", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for i, (name, extra) in enumerate(SETTINGS):
            if not args.json:
                print(f"[{i + 1}/{len(SETTINGS)}] {name} ...", flush=True)
            res[name] = run(args, extra, Path(d), f"s{i}")
    if args.json:
        print(json.dumps(res))
        return
    print(f"\n{args.experts} experts, top-{args.top_k}, ep2, {args.steps} steps")
    print(f"{'setting':<24} {'dropped':>8} {'max/mean load':>14} {'(layers avg)':>13} "
          f"{'loss':>7}")
    for name, r in res.items():
        print(f"{name:<24} {100 * r['dropped_share']:7.2f}% {r['imbalance_max']:14.2f} "
              f"{r['imbalance_mean']:13.2f} {r['loss']:7.4f}")


if __name__ == "__main__":
    main()
