"""Hugging Face DeepSeek-V3 (multi-head latent attention, YaRN, sigmoid routing over node
groups with the selection bias, shared experts, dense first blocks, routed scaling) in and out:
random ``DeepseekV3ForCausalLM`` models from small configs, saved locally, import into fived
with transformers' logits to 1e-5 — one rank with and without query compression, then tp2+SP,
ep2·tp2, ep2·pp2 and cp2 (ring and Ulysses) — and a fived checkpoint trained from one exports back, loading in
transformers with fived's logits. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
from test_hf import (  # noqa: E402
    SEQ,
    _layout_logits,
    close,
    hf_logits,
    tokens,
    train_and_export,
)

from fived.checkpoint import hf  # noqa: E402
from fived.config import ConfigError, ParallelConfig  # noqa: E402
from fived.testing import run_ranks  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.8}


def deepseek_config(q_lora: bool = True, yarn: bool = True, **over):
    kw = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=16 if q_lora else None, kv_lora_rank=12, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=3,
              n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
              max_position_embeddings=32, num_mtp_layers=0,
              rope_parameters=YARN if yarn else {"rope_type": "default", "rope_theta": 50000.0})
    kw.update(over)
    return transformers.DeepseekV3Config(**kw)


def make_deepseek(path, q_lora: bool = True, yarn: bool = True, **over):
    """A random DeepSeek-V3 saved to ``path``; returns it (eval, fp32). Norm gains away from 1,
    the selection bias away from 0 (it changes which experts are chosen)."""
    torch.manual_seed(0)
    m = transformers.DeepseekV3ForCausalLM(deepseek_config(q_lora, yarn, **over))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.mul_(1 + 0.1 * torch.randn_like(p))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    m.save_pretrained(path)
    return m.eval()


@pytest.mark.parametrize("q_lora,yarn", [(True, True), (False, False)])
def test_import_gives_transformers_logits(tmp_path, q_lora, yarn):
    ref = make_deepseek(tmp_path, q_lora, yarn)
    from fived.model import build_model

    cfg = hf.model_config(hf.read_config(tmp_path, "--init-from"), seq_len=SEQ)
    assert cfg.is_mla and cfg.kv_lora_rank == 12 and cfg.q_lora_rank == (16 if q_lora else 0)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (8, 4, 6)
    assert cfg.yarn == yarn and cfg.routed_scaling_factor == 2.5
    assert (cfg.route_groups, cfg.route_top_groups, cfg.shared_ffn) == (4, 2, 32)
    assert cfg.first_dense_layers == 1 and cfg.router == "sigmoid" and cfg.balance == "bias"
    model = build_model(cfg, 0)
    hf.load_hf_into(model, tmp_path)
    assert model.layers["1"].block_sparse_moe.route_bias.abs().max() > 0
    with torch.no_grad():
        got = model(tokens(), torch.arange(SEQ)).numpy()
    close(got, hf_logits(ref))


def test_interleaved_rope_rows_round_trip():
    cfg = hf.model_config(deepseek_config().to_dict())
    w = torch.randn(4 * 12, 16)
    for name in ("layers.0.self_attn.q_b_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        t = w if "q_b" in name else torch.randn(16, 32)
        there = hf.interleave_rope(name, t, cfg)
        assert not torch.equal(there, t)
        assert torch.equal(hf.interleave_rope(name, there, cfg, inverse=True), t)


def test_deepseek_refusals():
    base = deepseek_config().to_dict()
    for bad, word in [({"scoring_func": "softmax"}, "scoring_func"),
                      ({"n_shared_experts": 0}, "n_shared_experts"),
                      ({"attention_bias": True}, "attention_bias")]:
        with pytest.raises(ConfigError, match=word):
            hf.model_config({**base, **bad})
    cfg = hf.model_config(base)
    from dataclasses import replace
    with pytest.raises(ConfigError, match="router"):
        hf.hf_config(replace(cfg, router="softmax"))
    assert hf.hf_config(cfg)["model_type"] == "deepseek_v3"


def test_greedy_equals_transformers_generate(tmp_path):
    """fived generate's latent cache (absorbed decode steps) gives transformers' greedy tokens
    for a random DeepSeek-V3 (YaRN, query compression, groups, the selection bias)."""
    from fived.comm.ops import Traffic
    from fived.infer.generate import generate
    from fived.infer.model import inference_model
    from fived.ranks.grid import Grid

    ref = make_deepseek(tmp_path, max_position_embeddings=64)
    ref.generation_config.eos_token_id = None
    prompts = [[1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    want = []
    with torch.no_grad():
        for p in prompts:
            y = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                             pad_token_id=0)
            want.append(y[0, len(p):].tolist())
    cfg = hf.model_config(hf.read_config(tmp_path, "--hf"), "--hf", 64)
    grid = Grid.from_config(ParallelConfig(), 0).connect(Traffic())
    model = inference_model(cfg, grid, hf.HFSource(tmp_path, cfg, "--hf"), "cpu")
    assert generate(model, prompts, 12).tokens == want


def test_import_into_layouts_gives_transformers_logits(tmp_path):
    """--init-from into tp2+SP, ep2·tp2 and ep2·pp2 (the selection bias read too):
    transformers' logits to 1e-5 on every rank that holds them (cp2: the next test)."""
    d = tmp_path / "ds"
    ref = make_deepseek(d)
    jobs = [(d, ParallelConfig(tp=2, dp=2, sequence_parallel=True)),
            (d, ParallelConfig(ep=2, tp=2)),
            (d, ParallelConfig(ep=2, pp=2))]
    res = run_ranks(_layout_logits, 4, jobs, timeout=600)
    want = hf_logits(ref)
    for i in range(len(jobs)):
        got = [r[i] for r in res if r[i] is not None]
        assert got
        for g in got:
            close(g, want)


def test_import_at_cp2_gives_transformers_logits(tmp_path):
    """--init-from at cp2, ring and Ulysses over the decompressed heads (YaRN positions of
    each zigzag shard): transformers' logits to 1e-5, put back in sequence order."""
    from hf_ranks import _cp_logits

    ref = make_deepseek(tmp_path)
    want = hf_logits(ref)
    layouts = [ParallelConfig(cp=2), ParallelConfig(cp=2, cp_mode="ulysses")]
    for per_rank in run_ranks(_cp_logits, 2, tmp_path, layouts):
        for got in per_rank:
            close(got, want)


def test_export_loads_in_transformers_with_fived_logits(tmp_path):
    """Train 2 steps from a DeepSeek-V3 at ep2 (ZeRO-1), export: transformers loads a
    DeepseekV3ForCausalLM with DeepSeek's names (interleaved rotary rows, the selection bias as
    e_score_correction_bias) and gives fived's logits of the trained checkpoint."""
    src = tmp_path / "src"
    make_deepseek(src)
    cfg, ck, out = train_and_export(tmp_path, src, ParallelConfig(ep=2, zero=1))
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DeepseekV3ForCausalLM"] and conf["rope_interleave"]
    keys = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in keys
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in keys
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in keys
    from fived.checkpoint.convert import CheckpointSource, whole_model
    from fived.checkpoint.storage import read_manifest, resolve
    from fived.model import build_model

    ckpt = resolve(ck)
    man = read_manifest(ckpt)
    model = build_model(cfg, 0)
    model.load_state_dict(whole_model(ckpt, man), strict=False)
    for n, b in model.named_buffers():  # the trained selection biases
        b.copy_(CheckpointSource(ckpt, man).buffer(n))
    with torch.no_grad():
        mine = model(tokens(), torch.arange(SEQ)).numpy()
    trained = hf_logits(out)
    close(trained, mine)
    assert np.abs(trained - hf_logits(src)).max() > 1e-4
