"""MLA under context parallelism: the latent ring (``--cp-mode ring-latent``) against the
decompressed ring (``--cp-mode ring``) on one small MLA model, in one run on ``cp`` local gloo
ranks: the same model, its attention cores swapped between the two rings, alternated round by
round (ABBA), each round ``--steps`` forward + backward steps of the whole model (loss summed
over the rank's shard); the median step time (the slowest rank's), their ratio, and the bytes
one rank sent over cp per step as ``fived.comm`` counted them, with the ledger's
(``fived.ledger.traffic.cp_traffic``).

    PYTHONPATH=. python benchmarks/mla_latent_ring.py --cp 2 4 [--seq 1024] [--rounds 9]

The shape (``MODEL``): hidden 256, 16 heads, r_kv 64, d_n 32, d_r 16, d_v 32, no query
compression, 2 dense layers, batch 2: per token a decompressed block is K + V padded to d_q,
2·16·48·4 = 6,144 B in fp32, the latent (64 + 16)·4 = 320 B.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from fived.config import ParallelConfig, preset

MODEL = replace(preset("deepseek-v3-tiny"), name="mla-ring-bench", q_lora_rank=0, layers=2,
                hidden=256, heads=16, kv_heads=16, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, ffn=512, experts=0, shared_expert=False,
                shared_expert_ffn=0, route_groups=0, route_top_groups=0, first_dense_layers=0,
                balance="aux_loss", router="softmax", rope_factor=1.0, rope_mscale_all_dim=0.0)
MODES = ("ring", "ring-latent")


def _rank(rank: int, world: int, a: dict) -> dict:
    import torch
    import torch.distributed as dist

    from fived.comm.ops import Traffic
    from fived.model import build_model
    from fived.parallel import context
    from fived.ranks.grid import DimGroup

    torch.set_num_threads(1)
    traffic = Traffic()
    group = DimGroup("cp", tuple(range(world)), rank, dist.group.WORLD, traffic)
    m = replace(MODEL, seq_len=a["seq"])
    model = build_model(m, 1)
    cores = {"ring": [context.ContextAttention(group, "ring") for _ in model.layers.values()],
             "ring-latent": [context.LatentRing(group) for _ in model.layers.values()]}
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, m.vocab, (a["batch"], m.seq_len + 1), generator=gen)
    pos = context.shard_positions(m.seq_len, world, rank)
    tokens, targets = x[:, :-1][:, pos].contiguous(), x[:, 1:][:, pos].contiguous()

    def step(mode: str) -> tuple[float, float]:
        for blk, core in zip(model.layers.values(), cores[mode]):
            blk.self_attn.core = core
        dist.barrier()
        traffic.reset()
        t0 = time.perf_counter()
        model(tokens, pos, targets).backward()
        dt = torch.tensor([time.perf_counter() - t0])
        sent = traffic.bytes_by_dim().get("cp", 0.0)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        model.zero_grad(set_to_none=True)
        return float(dt), sent

    out = {mode: {"times": [], "sent": 0.0} for mode in MODES}
    for mode in MODES:  # warm-up
        step(mode)
    for r in range(a["rounds"]):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            for _ in range(a["steps"]):
                dt, sent = step(mode)
                out[mode]["times"].append(dt)
                out[mode]["sent"] = sent
    return out


def main() -> None:
    from fived.ledger.traffic import cp_traffic
    from fived.ranks.launch import run_local

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=2)
    a = vars(p.parse_args())
    m = replace(MODEL, seq_len=a["seq"])
    print(f"{m.name}: hidden {m.hidden}, H {m.heads}, r_kv {m.kv_lora_rank}, d_n "
          f"{m.qk_nope_head_dim}, d_r {m.qk_rope_head_dim}, d_v {m.v_head_dim}, {m.layers} "
          f"layers, seq {m.seq_len}, batch {a['batch']}; {a['rounds']} rounds x {a['steps']} "
          "steps, alternated")
    print(f"{'cp':>3} {'mode':>12} {'median ms':>10} {'sent B/step':>12} {'ledger B':>12}")
    for cp in a["cp"]:
        res = run_local(_rank, cp, (a,), timeout=1800)[0]
        med = {}
        for mode in MODES:
            par = ParallelConfig(cp=cp, cp_mode=mode)
            # one forward + backward of one micro-batch of a["batch"] sequences
            want = sum(c.bytes for c in cp_traffic(m, par, a["batch"]) if c.op == "send")
            med[mode] = statistics.median(res[mode]["times"])
            print(f"{cp:>3} {mode:>12} {med[mode] * 1e3:>10.1f} {res[mode]['sent']:>12,.0f} "
                  f"{want:>12,.0f}")
        print(f"{cp:>3} {'latent/ring':>12} {med['ring-latent'] / med['ring']:>10.3f}")


if __name__ == "__main__":
    main()
