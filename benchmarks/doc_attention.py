"""Which one-rank document-masked attention kernel is fastest on this machine (issue 41).

Forward + backward of one attention core, ``small``'s heads (8 query, 4 kv, head dim 16) at
seq 2048, batch 1, fp32, for mean document lengths S, S/4, S/16 (documents of exactly that
length, so Σ Lᵢ² = S·L). Kernels:

* ``causal``   — no mask (the unmasked baseline: S²/2 work);
* ``varlen``   — per-document SDPA calls (``fived.model.layers.doc_attention``: Σ Lᵢ²/2);
* ``sdpa-mask``— one SDPA call with the (S, S) boolean same-document-causal mask (S² work,
  the masked blocks computed and zeroed);
* ``flex``     — ``torch.nn.attention.flex_attention`` with a document block mask, eager
  (and compiled with ``--compile``, which builds a C++ kernel first).

    PYTHONPATH=. python benchmarks/doc_attention.py [--seq 2048] [--rounds 5] [--compile]

Prints the fastest of ``rounds`` interleaved rounds (milliseconds; the minimum, not the
median: the machine is shared, and load only ever adds time) per kernel and document length.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fived.model.documents import doc_mask
from fived.model.layers import causal_attention, doc_attention


def timed(fn, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1e3 * min(out)


def bench_length(L: int, q, k, v, flex, rounds: int, compiled: bool) -> None:
    """Every kernel at mean document length ``L``, interleaved ``rounds`` times."""
    S = q.shape[1]
    docs = (torch.arange(S) // L)[None]

    def run(f):
        def go():
            o = f()
            o.sum().backward()
            q.grad = k.grad = v.grad = None
        return go

    rows = {"causal": run(lambda: causal_attention(q, k, v)),
            "varlen": run(lambda: doc_attention(q, k, v, docs))}
    pos = torch.arange(S)
    m = doc_mask(pos, pos, docs)[:, None]

    def masked():
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m,
            enable_gqa=True).transpose(1, 2)

    rows["sdpa-mask"] = run(masked)
    if flex is not None:
        d0 = docs[0]

        def mod(b, h, qi, ki):
            return (d0[qi] == d0[ki]) & (qi >= ki)

        try:
            from torch.nn.attention.flex_attention import create_block_mask

            bm = create_block_mask(mod, 1, None, S, S, device="cpu")

            def fx():
                return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            block_mask=bm, enable_gqa=True).transpose(1, 2)

            rows["flex" + ("-compiled" if compiled else "")] = run(fx)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            print(f"flex attention unavailable: {type(e).__name__}: {str(e)[:120]}")
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in list(rows.items()):
            try:
                best[name] = min(best.get(name, float("inf")), timed(fn, 1))
            except Exception as e:  # noqa: BLE001
                print(f"{L:>9} {name:>10} failed: {type(e).__name__}: {str(e)[:100]}")
                del rows[name]
    for name, ms in best.items():
        print(f"{L:>9} {name:>10} {ms:>13.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    S, H, G, D = a.seq, 8, 4, 16
    q = torch.randn(1, S, H, D, requires_grad=True)
    k = torch.randn(1, S, G, D, requires_grad=True)
    v = torch.randn(1, S, G, D, requires_grad=True)
    flex = None
    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention) if a.compile else flex_attention
    except ImportError:
        pass
    print(f"seq {S}, heads {H}/{G}, head dim {D}, fp32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'mean doc':>9} {'kernel':>10} {'ms (fwd+bwd)':>13}")
    for L in (S, S // 4, S // 16):
        bench_length(L, q, k, v, flex, a.rounds, a.compile)


if __name__ == "__main__":
    main()
