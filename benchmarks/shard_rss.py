"""Corpora larger than memory (issue 41 item 6): peak RSS of ``fived data prepare --shard-mb``
and of training on the result, at three corpus sizes.

Generates a JSONL corpus of SIZE MB of text (documents of lognormal length, median 2,000
characters, from a 64-letter alphabet), prepares it byte-level into shards of ``--shard-mb``
MB with one worker, and trains ``tiny`` (seq 512, global batch 8, ``--doc-mask``) for
``--steps`` steps on one rank. Peak RSS: prepare's process (``getrusage`` of the child), the
training rank's ``rss_peak`` (VmHWM) from its metrics. Flat means: the same at every size.

    PYTHONPATH=. python benchmarks/shard_rss.py --sizes 20 40 80 --shard-mb 2 --dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def corpus(path: Path, mb: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .",
                             dtype=np.uint8)
    left = mb * 2**20
    with open(path, "w") as f:
        while left > 0:
            n = int(min(left, max(1, rng.lognormal(np.log(2000), 1.0))))
            text = alphabet[rng.integers(0, len(alphabet), n)].tobytes().decode()
            f.write(json.dumps({"text": text}) + "\n")
            left -= n


def child_peak(cmd: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes of the command's process, seconds)."""
    code = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=sys.stderr); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
            "time.perf_counter() - t, r.returncode)")
    out = subprocess.run([sys.executable, "-c", code, *cmd], stdout=subprocess.PIPE, text=True,
                         check=True).stdout.split()
    assert out[2] == "0", cmd
    return int(out[0]) * 1024, float(out[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 40, 80])
    ap.add_argument("--shard-mb", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dir", default="/tmp/fived-shard-rss")
    a = ap.parse_args()
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    fived = [sys.executable, "-m", "fived"]
    print(f"{'corpus':>8} {'shards':>7} {'prepare MB/s':>13} {'prepare peak RSS':>17} "
          f"{'train peak RSS':>15}")
    for mb in a.sizes:
        src, out = base / f"c{mb}.jsonl", base / f"d{mb}"
        if not src.exists():
            corpus(src, mb)
        rss, secs = child_peak([*fived, "data", "prepare", str(src), "--out", str(out),
                                "--shard-mb", str(a.shard_mb), "--workers", "1",
                                "--val-fraction", "0.01"])
        meta = json.loads((out / "meta.json").read_text())
        shards = len(meta["splits"]["train"].get("shards", [1]))
        m = base / f"m{mb}.jsonl"
        subprocess.run([*fived, "train", "--data", str(out), "--seq-len", "512",
                        "--global-batch", "8", "--steps", str(a.steps), "--nprocs", "1",
                        "--doc-mask", "--metrics-out", str(m)], stdout=subprocess.DEVNULL,
                       check=True)
        recs = [json.loads(x) for x in m.read_text().splitlines() if x.startswith("{")]
        train_rss = max(r.get("rss_peak", 0) for r in recs)
        print(f"{mb:>6}MB {shards:>7} {mb / secs:>13.1f} {rss / 2**20:>14.1f} MB "
              f"{train_rss / 2**20:>12.1f} MB", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s; ru_maxrss of this process "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
