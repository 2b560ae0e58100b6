"""MLA generation on this CPU: the latent cache with the up-projections absorbed into the query
and output, against expanding the cached latent every step; prefill and decode timed apart,
each the median of 3 runs; the cache's bytes per token against GQA's formula.

    .venv/bin/python benchmarks/mla_generate.py [--context 1024] [--new 32]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from fived.config import preset
from fived.infer.generate import generate
from fived.model import build_model
from fived.model.mla import MLAttention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    # DeepSeek-V3's attention widths (r_kv 512, d_r 64, d_n 128, d_v 128), 16 heads, 4 dense
    # blocks of a 1024-wide model: the attention's share of a decode step is the subject
    cfg = replace(preset("deepseek-v3-671b"), name="mla-bench", vocab=1024, hidden=1024,
                  layers=4, heads=16, kv_heads=16, ffn=2048, q_lora_rank=256, experts=0,
                  first_dense_layers=0, shared_expert=False, route_groups=0,
                  route_top_groups=0, balance="aux_loss", router="softmax",
                  seq_len=a.context + a.new)
    model = build_model(cfg, 0).eval()
    prompt = [[1 + i % (cfg.vocab - 1) for i in range(a.context)]]
    rows = {}
    for mode in ("expand", "absorb", "auto"):
        for m in model.modules():
            if isinstance(m, MLAttention):
                m.absorb = {"expand": False, "absorb": True, "auto": "auto"}[mode]
        runs = [generate(model, prompt, a.new) for _ in range(3)]
        rows[mode] = (statistics.median(r.prefill_s for r in runs),
                      statistics.median(r.decode_s / max(r.decode_steps, 1) for r in runs),
                      runs[0].tokens[0], runs[0].cache_bytes)
    assert rows["expand"][2] == rows["absorb"][2] == rows["auto"][2], "the tokens differ"
    slots = a.context + a.new
    latent = cfg.layers * slots * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    gqa = 2 * cfg.layers * slots * cfg.heads * cfg.qk_head_dim * 4  # the heads MLA expands to
    print(f"context {a.context}, {a.new} new tokens, {a.threads} threads, fp32")
    print(f"{'mode':8} {'prefill s':>10} {'decode ms/token':>16}")
    for mode, (pre, dec, _, nbytes) in rows.items():
        assert nbytes == latent
        print(f"{mode:8} {pre:10.3f} {dec * 1e3:16.2f}")
    per = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    print(f"cache per token per layer: {per} B (r_kv + d_r = "
          f"{cfg.kv_lora_rank + cfg.qk_rope_head_dim} fp32), GQA's 2·heads·d_q·4 = "
          f"{2 * cfg.heads * cfg.qk_head_dim * 4} B ({gqa / latent:.1f}x); total {latent} B")


if __name__ == "__main__":
    main()
