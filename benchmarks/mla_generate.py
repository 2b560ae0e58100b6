"""MLA generation on this CPU: the latent cache with the up-projections absorbed into the query
and output, against expanding the cached latent every step; prefill and decode timed apart,
each the median of 3 runs; the cache's bytes per token against GQA's formula. With
``--vs-transformers``: fived's greedy generation against transformers' ``generate`` on the same
random DeepSeek-V3 (saved locally, both read it), alternating, the same threads.

    .venv/bin/python benchmarks/mla_generate.py [--context 1024] [--new 32]
    .venv/bin/python benchmarks/mla_generate.py --vs-transformers [--context 256] [--new 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from fived.config import preset
from fived.infer.generate import generate
from fived.model import build_model
from fived.model.mla import MLAttention


def vs_transformers(a: argparse.Namespace) -> None:
    import tempfile

    import transformers

    from fived.checkpoint import hf
    from fived.comm.ops import Traffic
    from fived.config import ParallelConfig
    from fived.infer.model import inference_model
    from fived.ranks.grid import Grid

    torch.manual_seed(0)  # DeepSeek-V3's attention widths, 16 heads, 4 blocks (1 dense)
    ref = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=256,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=a.context + a.new,
        num_mtp_layers=0)).eval()
    ref.generation_config.eos_token_id = None
    prompt = [[1 + i % 1023 for i in range(a.context)]]
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        cfg = hf.model_config(hf.read_config(d, "--hf"), "--hf", a.context + a.new)
        grid = Grid.from_config(ParallelConfig(), 0).connect(Traffic())
        mine = inference_model(cfg, grid, hf.HFSource(d, cfg, "--hf"), "cpu")
    times: dict[str, list[float]] = {"fived": [], "transformers": []}
    toks = {}
    for _ in range(3):
        t0 = time.perf_counter()
        toks["fived"] = generate(mine, prompt, a.new).tokens[0]
        times["fived"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            y = ref.generate(torch.tensor(prompt), max_new_tokens=a.new, do_sample=False,
                             pad_token_id=0)
        times["transformers"].append(time.perf_counter() - t0)
        toks["transformers"] = y[0, a.context:].tolist()
    assert toks["fived"] == toks["transformers"], "the greedy tokens differ"
    f, t = statistics.median(times["fived"]), statistics.median(times["transformers"])
    print(f"context {a.context}, {a.new} new tokens, {a.threads} threads, fp32, median of 3")
    print(f"fived {f:.2f} s, transformers {t:.2f} s: fived / transformers = {f / t:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vs-transformers", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.vs_transformers:
        vs_transformers(a)
        return
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
