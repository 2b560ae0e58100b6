"""Part 6, sequence and context parallelism: activation memory per rank against sequence length,
and the zigzag balance.

* ``context-activations``  for tp, tp+SP, ring CP and Ulysses CP over n spawned ranks, the bytes
  autograd saved for backward on rank 0 during one forward of the whole (cut) model
  (``fived.train.activations.SavedTensors``, parameters excluded) at growing sequence lengths,
  beside the ledger's activation terms (``fived.ledger.memory.activations``) and the one-rank
  ledger line;
* ``context-zigzag``       forward attention FLOPs each cp rank's ring kernel executed
  (``AttentionStats``, via ``fived bench cp``'s rank function) with the contiguous layout and with
  zigzag, beside ``fived.ledger.context.attention_flops``: contiguous leaves the last rank with
  most of the causal work, zigzag (chunks r and 2n−1−r) evens it out.

``fived figures context --out DIR [--quick]`` (quick: n = 2, two sequence lengths).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import ModelConfig, ParallelConfig
from ._fig import COLORS, Figure, part_main

MODEL = ModelConfig(name="fig-cp", vocab=256, hidden=64, layers=2, heads=4, kv_heads=4,
                    ffn=176, seq_len=64)
BATCH = 1


def layouts(n: int) -> dict[str, ParallelConfig]:
    return {"tp": ParallelConfig(tp=n), "tp+SP": ParallelConfig(tp=n, sequence_parallel=True),
            "ring CP": ParallelConfig(cp=n, cp_mode="ring"),
            "Ulysses CP": ParallelConfig(cp=n, cp_mode="ulysses")}


def act_rank(rank: int, world: int, seqs: list[int]) -> dict[str, dict[str, int]]:
    import torch

    from ..comm.ops import Traffic
    from ..model import build_model
    from ..parallel.context import shard_batch
    from ..parallel.parallelize import parallelize_parts
    from ..ranks.grid import Grid
    from ..train.activations import SavedTensors

    out: dict[str, dict[str, int]] = {}
    for name, par in layouts(world).items():
        grid = Grid.from_config(par, rank).connect(Traffic())
        for s in seqs:
            m = replace(MODEL, seq_len=s)
            (model,), _ = parallelize_parts(build_model(m, 1), grid, par)
            x = torch.randint(0, m.vocab, (BATCH, s), generator=torch.Generator().manual_seed(s))
            pos = torch.arange(s)
            if par.cp > 1:
                x, y, pos = shard_batch(x, x, grid)
            with SavedTensors(list(model.parameters())) as saved:
                loss = model(x, pos, x)
            loss.backward()
            out.setdefault(name, {})[str(s)] = saved.bytes
    return out


def activations(n: int, seqs: list[int]) -> dict[str, Any]:
    from ..ledger import memory
    from ..testing import run_ranks

    meas = run_ranks(act_rank, n, seqs, timeout=600)[0]
    ledger = {name: {str(s): sum(memory.activations(replace(MODEL, seq_len=s), par, BATCH).values())
                     for s in seqs} for name, par in layouts(n).items()}
    one = {str(s): sum(memory.activations(replace(MODEL, seq_len=s), ParallelConfig(), BATCH).values())
           for s in seqs}
    return {"world": n, "model": MODEL.name, "batch": BATCH, "seqs": seqs, "measured": meas,
            "ledger": ledger, "one_rank_ledger": one}


def draw_acts(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    xs = d["seqs"]
    for i, name in enumerate(d["measured"]):
        ax.plot(xs, [d["measured"][name][str(s)] / 1e6 for s in xs], marker="o",
                color=COLORS[i], label=f"{name} measured")
        ax.plot(xs, [d["ledger"][name][str(s)] / 1e6 for s in xs], ls="--", lw=0.8,
                color=COLORS[i])
    ax.plot(xs, [d["one_rank_ledger"][str(s)] / 1e6 for s in xs], color="black", ls=":",
            label="1 rank (ledger)")
    ax.plot([], [], color="gray", ls="--", label="ledger")
    ax.set(xscale="log", yscale="log", xlabel="sequence length",
           ylabel="activation MB saved on rank 0", title=f"n = {d['world']} ranks, batch 1")
    ax.set_xticks(xs, [str(s) for s in xs])
    from matplotlib.ticker import NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.legend(fontsize=8)


def zigzag(n: int, seq: int) -> dict[str, Any]:
    from ..bench.cp import _bench_rank
    from ..ledger.context import attention_flops
    from ..testing import run_ranks

    a = {"batch": 1, "seq": seq, "heads": 4, "kv_heads": 2, "head_dim": 16, "iters": 1,
         "warmup": 0, "modes": ["ring-contiguous", "ring"]}
    out = run_ranks(_bench_rank, n, a, timeout=600)[0]
    return {"world": n, "seq": seq, "shape": {k: a[k] for k in ("batch", "heads", "kv_heads",
                                                               "head_dim")},
            "measured": {"contiguous": out["ring-contiguous"]["flops_per_rank"],
                         "zigzag": out["ring"]["flops_per_rank"]},
            "ledger": {lay: attention_flops(1, seq, 4, 16, n, lay)
                       for lay in ("contiguous", "zigzag")}}


def draw_zigzag(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    n = d["world"]
    for j, lay in enumerate(("contiguous", "zigzag")):
        xs = [r + 0.38 * j for r in range(n)]
        ax.bar(xs, [v / 1e6 for v in d["measured"][lay]], width=0.36, color=COLORS[j],
               label=f"{lay} measured")
        ax.scatter(xs, [v / 1e6 for v in d["ledger"][lay]], marker="_", s=200, color="black",
                   zorder=3, label="ledger" if j == 0 else None)
    ax.set_xticks([r + 0.19 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set(ylabel="forward attention MFLOP", title=f"ring attention, seq {d['seq']}, cp={n}")
    ax.legend(fontsize=8)


def figures(quick: bool, tick) -> list[Figure]:
    n = 2 if quick else 4
    seqs = [32, 64] if quick else [64, 128, 256, 512]
    tick(f"context: activations of 4 layouts on {n} ranks")
    acts = activations(n, seqs)
    tick(f"context: zigzag vs contiguous on {n} ranks")
    zz = zigzag(n, 64 if quick else 512)
    return [
        Figure("context-activations", "Activation memory per rank vs sequence length",
               "context", "ledger+run", "one forward of the cut model on spawned gloo ranks "
               "under SavedTensors (rank 0), beside fived.ledger.memory.activations", acts,
               draw_acts),
        Figure("context-zigzag", "Causal balance: attention FLOPs per cp rank", "context",
               "ledger+run", "fived.bench.cp's rank function (ring attention AttentionStats) "
               "beside fived.ledger.context.attention_flops", zz, draw_zigzag),
    ]


main = part_main("context", figures, __doc__)
