"""Hugging Face Qwen2-MoE (a sigmoid-gated shared expert, q/k/v biases, weights not
renormalised) and Qwen3-MoE (many narrow experts, top-k renormalised, q/k norms, head_dim ≠
hidden/heads) in and out: random transformers models from small configs, with a leading dense
block (``mlp_only_layers = [0]``), saved locally, import into fived with transformers' logits to
1e-5 — one rank, ep2·tp2 and ep2·pp2 — and a fived checkpoint trained from them at ep2 exports
back as the same family, loading in transformers with fived's logits. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
from test_hf import (  # noqa: E402
    SEQ,
    SHAPE,
    _layout_logits,
    check_export_is_trained,
    close,
    hf_logits,
    tokens,
    train_and_export,
)

from fived.checkpoint import hf  # noqa: E402
from fived.config import ConfigError, ParallelConfig  # noqa: E402
from fived.testing import run_ranks  # noqa: E402

MOE = dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=16, mlp_only_layers=[0],
           router_aux_loss_coef=0.01)


def make_qwen_moe(path, kind: str):
    """A random Qwen2-MoE / Qwen3-MoE saved to ``path``; returns it (eval, fp32). Norm gains
    away from 1, biases away from 0, the shared-expert gate away from 0."""
    torch.manual_seed(0)
    if kind == "qwen2_moe":
        m = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **SHAPE, **MOE, shared_expert_intermediate_size=24, norm_topk_prob=False,
            qkv_bias=True))
    else:
        m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SHAPE, **MOE, head_dim=12, norm_topk_prob=True))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.mul_(1 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias") or "shared_expert_gate" in n:
                p.copy_(0.3 * torch.randn_like(p))
    m.save_pretrained(path)
    return m.eval()


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_import_gives_transformers_logits(tmp_path, kind):
    ref = make_qwen_moe(tmp_path, kind)
    from fived.model import build_model

    cfg = hf.model_config(hf.read_config(tmp_path, "--init-from"), seq_len=SEQ)
    assert (cfg.experts, cfg.top_k, cfg.expert_ffn, cfg.ffn) == (8, 4, 16, SHAPE["intermediate_size"])
    assert cfg.first_dense_layers == 1 and cfg.router == "softmax"
    if kind == "qwen2_moe":
        assert cfg.shared_expert and cfg.shared_ffn == 24 and cfg.shared_expert_gate
        assert cfg.qkv_bias and not cfg.qk_norm and not cfg.norm_topk_prob
    else:
        assert not cfg.shared_expert and cfg.qk_norm and cfg.norm_topk_prob
        assert cfg.head_dim == 12
    model = build_model(cfg, 0)
    hf.load_hf_into(model, tmp_path)
    with torch.no_grad():
        got = model(tokens(), torch.arange(SEQ)).numpy()
    close(got, hf_logits(ref))


def test_import_into_ep_tp_pp_layouts_gives_transformers_logits(tmp_path):
    dirs = {k: tmp_path / k for k in ("qwen2_moe", "qwen3_moe")}
    refs = {k: make_qwen_moe(d, k) for k, d in dirs.items()}
    jobs = [(dirs["qwen2_moe"], ParallelConfig(ep=2, tp=2)),
            (dirs["qwen3_moe"], ParallelConfig(ep=2, tp=2, sequence_parallel=True)),
            (dirs["qwen2_moe"], ParallelConfig(ep=2, pp=2)),
            (dirs["qwen3_moe"], ParallelConfig(ep=2, pp=2))]
    res = run_ranks(_layout_logits, 4, jobs, timeout=600)
    for i, (d, _) in enumerate(jobs):
        got = [r[i] for r in res if r[i] is not None]
        assert got
        for g in got:
            close(g, hf_logits(refs[d.name]))


@pytest.mark.parametrize("kind", ["qwen2_moe", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_export_loads_in_transformers_with_fived_logits(tmp_path, kind):
    """Train 2 steps from a Qwen-MoE model at ep2 (ZeRO-1), export, load in transformers: its
    family, Qwen's per-expert names, fived's logits, the trained (not the original) weights."""
    src = tmp_path / "src"
    make_qwen_moe(src, kind)
    cfg, ck, out = train_and_export(tmp_path, src, ParallelConfig(ep=2, zero=1))
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [hf.FAMILIES[kind]] and conf["mlp_only_layers"] == [0]
    keys = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # the dense block
    assert not any("block_sparse_moe" in k for k in keys)
    check_export_is_trained(cfg, ck, out, src)


def test_names_both_ways():
    for name, want in [
        ("layers.1.block_sparse_moe.experts.3.w1.weight", "model.layers.1.mlp.experts.3.gate_proj.weight"),
        ("layers.1.block_sparse_moe.experts.3.w3.weight", "model.layers.1.mlp.experts.3.up_proj.weight"),
        ("layers.1.block_sparse_moe.experts.3.w2.weight", "model.layers.1.mlp.experts.3.down_proj.weight"),
        ("layers.1.block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight"),
        ("layers.1.block_sparse_moe.shared_expert.up_proj.weight",
         "model.layers.1.mlp.shared_expert.up_proj.weight"),
        ("layers.1.block_sparse_moe.shared_expert_gate.weight",
         "model.layers.1.mlp.shared_expert_gate.weight"),
        ("layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight"),
    ]:
        assert hf.to_hf_name(name, "qwen2_moe") == want
        assert hf.from_qwen_moe_name(want[len("model."):]) == name
    assert hf.to_hf_name("layers.1.block_sparse_moe.experts.3.w1.weight", "mixtral") == \
        "model.layers.1.block_sparse_moe.experts.3.w1.weight"


def test_qwen_moe_refusals():
    base = {"model_type": "qwen3_moe", "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 256,
            "intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16}
    for bad, word in [({"mlp_only_layers": [1]}, "mlp_only_layers"),
                      ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
                      ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 0},
                       "shared_expert_intermediate_size")]:
        with pytest.raises(ConfigError, match=word):
            hf.model_config({**base, **bad})
    cfg = hf.model_config(base)
    from dataclasses import replace
    for bad, word in [(dict(router="sigmoid"), "router"), (dict(shared_expert=True), "shared_expert"),
                      (dict(route_groups=2, route_top_groups=1), "route_groups")]:
        with pytest.raises(ConfigError, match=word):
            hf.hf_config(replace(cfg, **bad))
    q2 = replace(cfg, qk_norm=False, shared_expert=True, shared_expert_ffn=24)
    with pytest.raises(ConfigError, match="shared_expert_gate"):  # Qwen2-MoE always gates
        hf.hf_config(q2)
    assert hf.hf_config(replace(q2, shared_expert_gate=True))["model_type"] == "qwen2_moe"
