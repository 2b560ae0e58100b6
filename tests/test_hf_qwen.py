"""Hugging Face Qwen2 (q/k/v biases) and Qwen3 (q/k norms, head_dim ≠ hidden/heads) dense models
in and out: transformers models from small random configs saved locally import into fived with
transformers' logits to 1e-5 (one rank and tp2), and a fived checkpoint trained from them exports
back as the same family, loading in transformers with fived's logits. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

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
from fived.config import ConfigError, ParallelConfig, preset  # noqa: E402
from fived.testing import run_ranks  # noqa: E402

HEAD = 12  # Qwen3's head_dim: 4 heads of 12 on a hidden of 32


def make_qwen(path, kind: str, tied: bool = False, **kw):
    """A random Qwen2/Qwen3 model saved to ``path``; returns it (eval, fp32). Norm gains away
    from 1 and biases away from 0 (transformers initialises them to 0), so a missed norm or
    bias, or a wrong eps, shows in the logits."""
    torch.manual_seed(0)
    if kind == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **{**SHAPE, **kw}, tie_word_embeddings=tied))
    else:
        m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **{**SHAPE, **kw}, head_dim=HEAD, tie_word_embeddings=tied))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.mul_(1 + 0.1 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    m.save_pretrained(path)
    return m.eval()


@pytest.mark.parametrize("kind,tied", [("qwen2", False), ("qwen3", False), ("qwen3", True)])
def test_import_gives_transformers_logits(tmp_path, kind, tied):
    ref = make_qwen(tmp_path, kind, tied)
    from fived.model import build_model

    cfg = hf.model_config(hf.read_config(tmp_path, "--init-from"), seq_len=SEQ)
    assert (cfg.qkv_bias, cfg.qk_norm) == ((True, False) if kind == "qwen2" else (False, True))
    assert cfg.head_dim == (HEAD if kind == "qwen3" else 8)
    assert cfg.head_size == (HEAD if kind == "qwen3" else 0)  # 0: hidden/heads
    assert cfg.rope_theta == 50000.0 and cfg.norm_eps == 1e-6 and cfg.tied_embeddings == tied
    model = build_model(cfg, 0)
    hf.load_hf_into(model, tmp_path)
    with torch.no_grad():
        got = model(tokens(), torch.arange(SEQ)).numpy()
    close(got, hf_logits(ref))


def test_import_into_tp2_gives_transformers_logits(tmp_path):
    """tp2 (the biases cut with their columns, the q/k norms whole), with and without SP; a
    one-kv-head Qwen2 at tp2 (the kv head and its k/v biases replicated)."""
    dirs = {k: tmp_path / k for k in ("qwen2", "qwen3", "qwen2-kv1")}
    refs = {"qwen2": make_qwen(dirs["qwen2"], "qwen2"), "qwen3": make_qwen(dirs["qwen3"], "qwen3"),
            "qwen2-kv1": make_qwen(dirs["qwen2-kv1"], "qwen2", num_key_value_heads=1)}
    jobs = [(dirs["qwen2"], ParallelConfig(tp=2)),
            (dirs["qwen3"], ParallelConfig(tp=2, sequence_parallel=True)),
            (dirs["qwen2-kv1"], ParallelConfig(tp=2))]
    res = run_ranks(_layout_logits, 2, jobs, timeout=600)
    for i, name in enumerate(["qwen2", "qwen3", "qwen2-kv1"]):
        got = [r[i] for r in res if r[i] is not None]
        assert len(got) == 2
        for g in got:
            close(g, hf_logits(refs[name]))


@pytest.mark.parametrize("kind", ["qwen3", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_export_loads_in_transformers_with_fived_logits(tmp_path, kind):
    """Train 2 steps from a Qwen model at tp2 (ZeRO-1), export, load in transformers: its
    family, fived's logits, and the trained (not the original) weights."""
    src = tmp_path / "src"
    make_qwen(src, kind)
    cfg, ck, out = train_and_export(tmp_path, src, ParallelConfig(tp=2, zero=1))
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [hf.FAMILIES[kind]] and conf["model_type"] == kind
    assert conf["head_dim"] == cfg.head_dim
    check_export_is_trained(cfg, ck, out, src)


def test_attention_mapping_both_ways():
    """Qwen3-30B-A3B's attention (hidden 2048, 32 heads of 128, 4 kv heads): head_size 128;
    each family's config.json maps back to the fived config it came from."""
    a, p = hf.attention_fields({"model_type": "qwen3_moe", "hidden_size": 2048,
                                "num_attention_heads": 32, "num_key_value_heads": 4,
                                "head_dim": 128})
    assert p == [] and a == {"heads": 32, "kv_heads": 4, "head_size": 128, "qk_norm": True,
                             "qkv_bias": False}
    a, _ = hf.attention_fields({"model_type": "qwen2_moe", "hidden_size": 64,
                                "num_attention_heads": 4, "qkv_bias": False})
    assert a["qkv_bias"] is False and a["head_size"] == 0 and a["kv_heads"] == 4
    base = replace(preset("tiny"), name="hf")
    for cfg, family in ((base, "llama"), (replace(base, qkv_bias=True), "qwen2"),
                        (replace(base, qk_norm=True, head_size=24), "qwen3"),
                        (replace(base, qkv_bias=True, head_size=8), "qwen2")):
        conf = hf.hf_config(cfg)
        assert conf["model_type"] == family
        back = hf.model_config(conf, seq_len=cfg.seq_len)
        assert replace(back, name="hf") == cfg, family


def test_qwen_refusals():
    def refused(conf: dict, words: str):
        full = {"model_type": "qwen3", "hidden_size": 32, "num_attention_heads": 4,
                "num_hidden_layers": 2, "vocab_size": 256, "intermediate_size": 48, **conf}
        with pytest.raises(ConfigError, match=words):
            hf.model_config(full)

    refused({"attention_bias": True}, "bias on o_proj")
    refused({"use_sliding_window": True}, "sliding-window")
    refused({"model_type": "qwen2", "hidden_size": 30}, "no head_dim")
    tiny = preset("tiny")
    with pytest.raises(ConfigError, match="qkv_bias = true; transformers' qwen3 has no"):
        hf.hf_config(replace(tiny, qk_norm=True, qkv_bias=True))  # Qwen3's bias is on o too
    assert hf.hf_config(replace(preset("tiny-moe"), qk_norm=True))["model_type"] == "qwen3_moe"
    with pytest.raises(ConfigError, match="Qwen3-MoE has only shared_expert = False"):
        hf.hf_config(replace(preset("tiny-moe"), qk_norm=True, shared_expert=True,
                             shared_expert_gate=True))


@pytest.mark.parametrize("kind", ["qwen3", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_greedy_equals_transformers_generate_on_one_rank_and_tp2(tmp_path, kind):
    """The KV cache with the new shapes: 32 greedy tokens from 3 prompts equal transformers'
    ``generate``, with the cache and without it, on one rank and on tp2."""
    from test_generate import NEW, PROMPTS, _tp_generate, hf_greedy, no_cache
    from test_generate import one_rank as inference_one_rank

    ref = make_qwen(tmp_path, kind)
    ref.generation_config.eos_token_id = None  # 32 tokens whatever comes
    want = hf_greedy(ref, PROMPTS)
    cfg = hf.model_config(hf.read_config(tmp_path, "--hf"), "--hf", 128)
    model = inference_one_rank(cfg, hf.HFSource(tmp_path, cfg, "--hf"))
    from fived.infer.generate import generate

    got = generate(model, PROMPTS, NEW)
    assert got.tokens == want
    assert [no_cache(model, p, NEW) for p in PROMPTS] == want
    slots = max(map(len, PROMPTS)) + NEW  # 2 · layers · b · slots · kv_heads · head_dim fp32
    assert got.cache_bytes == 2 * cfg.layers * 3 * slots * cfg.kv_heads * cfg.head_dim * 4
    for tp_got in run_ranks(_tp_generate, 2, str(tmp_path)):
        assert tp_got == want
