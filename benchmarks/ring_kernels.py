"""The ring attention's fused block kernels against its explicit math, on one device.

Ring context parallelism (``fived.parallel.context``) runs each (q chunk, K/V block) pair
through a fused kernel that returns the block's log-sum-exp — the CPU flash kernel on the
CPU, the memory-efficient kernel on a GPU — and merges the blocks exactly; the explicit math
(``fused=False``) materialises the block's fp32 scores. This script checks, on the device it
is given, that both give the same block outputs, log-sum-exps and gradients (the backward
with a merged row's output and log-sum-exp, as the ring calls it), fp32, causal and not,
GQA and not:

    python benchmarks/ring_kernels.py [--device cuda]

It prints one line per case and exits 1 when a gap exceeds 1e-4 (benchmarks/gpu_check.sh
runs it on the GPU; tests/test_context.py runs it on the CPU).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from fived.parallel.context import _block_backward, _block_forward

TOLERANCE = 1e-4


def gaps(device: str, causal: bool, rep: int, seed: int = 0) -> dict[str, float]:
    """Largest absolute gaps between the fused kernel and the math, one block pair."""
    g = torch.Generator().manual_seed(seed)
    b, kv, sq, d = 2, 2, 64, 32
    q = torch.randn(b, kv, rep, sq, d, generator=g).to(device)
    k, v = (torch.randn(b, kv, sq, d, generator=g).to(device) for _ in range(2))
    do = torch.randn(b, kv, rep, sq, d, generator=g).to(device)
    scale = 1.0 / math.sqrt(d)
    o_f, lse_f = _block_forward(q, k, v, causal, scale, True)
    o_m, lse_m = _block_forward(q, k, v, causal, scale, False)
    delta = (do * o_m).sum(-1)
    grads_f = _block_backward(q, k, v, causal, lse_m, do, o_m, delta, scale, True)
    grads_m = _block_backward(q, k, v, causal, lse_m, do, o_m, delta, scale, False)
    out = {"out": (o_f - o_m).abs().max().item(), "lse": (lse_f - lse_m).abs().max().item()}
    for name, a, m in zip(("dq", "dk", "dv"), grads_f, grads_m):
        out[name] = (a - m).abs().max().item()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    worst = 0.0
    for causal in (False, True):
        for rep in (1, 2):
            got = gaps(args.device, causal, rep)
            worst = max(worst, *got.values())
            cells = "  ".join(f"{k} {v:.1e}" for k, v in got.items())
            print(f"{args.device} causal={causal!s:5} rep={rep}: {cells}")
    print(f"largest gap {worst:.1e} (tolerance {TOLERANCE:.0e})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
