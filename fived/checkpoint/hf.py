"""Hugging Face in and out: ``config.json`` + safetensors <-> fived's model config and tensors.

fived's parameter names *are* Hugging Face's Llama / Mixtral names without the ``model.``
prefix, so the tensor mapping is a rename (``lm_head.weight`` has no prefix; a tied model has
no ``lm_head.weight``):

    fived                                         Hugging Face
    embed_tokens.weight                           model.embed_tokens.weight
    layers.i.self_attn.{q,k,v,o}_proj.weight      model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers.i.mlp.{gate,up,down}_proj.weight       model.layers.i.mlp.{gate,up,down}_proj.weight
    layers.i.{input,post_attention}_layernorm.w   model.layers.i.{...}_layernorm.weight
    layers.i.block_sparse_moe.gate.weight         model.layers.i.block_sparse_moe.gate.weight
    layers.i.block_sparse_moe.experts.e.w{1,3,2}  model.layers.i.block_sparse_moe.experts.e.w{1,3,2}
    norm.weight, lm_head.weight                   model.norm.weight, lm_head.weight

Export writes the classic Mixtral expert names (what both transformers 4 and 5 load); import
also reads transformers 5's fused experts (``mlp.experts.gate_up_proj`` = [w1; w3] stacked
over experts, ``mlp.experts.down_proj`` = w2 stacked, ``mlp.gate`` = the router).

The config mapping is exact for what both models compute: RMSNorm in fp32 with
``rms_norm_eps``; RoPE with ``rope_theta``, rotate-half layout, ``head_dim = hidden / heads``;
GQA with ``num_key_value_heads``; SwiGLU (``hidden_act = silu``), no biases; Mixtral routing =
softmax in fp32, top-k, renormalised by the top-k sum (fived's ``w = v / Σ v``). What
transformers' Llama/Mixtral cannot represent is refused with a ConfigError: a shared expert,
other activations, biases, rope scaling, a ``head_dim`` other than hidden/heads. A fived MoE
trained with ``capacity_factor > 0`` drops tokens over capacity; transformers' Mixtral is
dropless, so export says so (the weights are the same, the forward differs when tokens drop).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ModelConfig

FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


# ------------------------------------------------------------------ configs
def read_config(hf_dir: str | Path, flag: str) -> dict[str, Any]:
    p = Path(hf_dir)
    if not p.is_dir():
        raise ConfigError([f"{flag} {hf_dir}: no such directory"])
    if not (p / "config.json").is_file():
        raise ConfigError([f"{flag} {hf_dir}: no config.json (not a Hugging Face model "
                           "directory)"])
    try:
        return json.loads((p / "config.json").read_text())
    except ValueError as e:
        raise ConfigError([f"{flag} {p / 'config.json'}: not valid JSON ({e})"]) from None


def model_config(hf: dict[str, Any], flag: str = "--init-from", seq_len: int | None = None
                 ) -> ModelConfig:
    """fived's ModelConfig of a Hugging Face Llama / Mixtral config.json (a ConfigError names
    what fived cannot represent)."""
    mt = hf.get("model_type")
    if mt not in ("llama", "mixtral"):
        raise ConfigError([f"{flag}: model_type {mt!r} is another model family; fived reads "
                           "'llama' (LlamaForCausalLM) and 'mixtral' (MixtralForCausalLM)"])
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    problems = []
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rtype = rope.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type") or (
        hf.get("rope_scaling") or {}).get("type") or "default"
    if rtype != "default":
        problems.append(f"{flag}: rope scaling {rtype!r} is not supported (plain RoPE only)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"{flag}: hidden_act {hf.get('hidden_act')!r} (fived's MLP is SwiGLU)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append(f"{flag}: biases in attention/MLP are not supported")
    if hf.get("head_dim") not in (None, h // heads) or h % heads:
        problems.append(f"{flag}: head_dim {hf.get('head_dim')} != hidden_size / heads")
    if problems:
        raise ConfigError(problems)
    ffn = hf["intermediate_size"]
    cfg = ModelConfig(
        name=f"hf-{mt}", vocab=hf["vocab_size"], hidden=h, layers=hf["num_hidden_layers"],
        heads=heads, kv_heads=hf.get("num_key_value_heads") or heads, ffn=ffn,
        rope_theta=float(theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)))
    if mt == "mixtral":
        cfg = replace(cfg, experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                      moe_ffn=0, shared_expert=False, capacity_factor=0.0,
                      aux_loss_coef=float(hf.get("router_aux_loss_coef", cfg.aux_loss_coef)))
    if seq_len is not None:
        cfg = replace(cfg, seq_len=seq_len)
    return cfg


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The config.json transformers loads as LlamaForCausalLM / MixtralForCausalLM."""
    problems = []
    if cfg.is_moe and cfg.shared_expert:
        problems.append("export: this MoE has a shared expert; transformers' Mixtral has none "
                        "(no MixtralForCausalLM can hold it)")
    if problems:
        raise ConfigError(problems)
    out: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if cfg.is_moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if cfg.is_moe else "llama",
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden,
        "intermediate_size": cfg.expert_ffn if cfg.is_moe else cfg.ffn,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max(cfg.seq_len, 2048), "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tied_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,
    }
    if cfg.is_moe:
        out.update({"num_local_experts": cfg.experts, "num_experts_per_tok": cfg.top_k,
                    "router_aux_loss_coef": cfg.aux_loss_coef, "output_router_logits": False,
                    "router_jitter_noise": 0.0, "sliding_window": None})
    else:
        out["mlp_bias"] = False
    return out


# ------------------------------------------------------------------ tensors
def to_hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


def read_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local HF directory (``model.safetensors`` or the shards its index
    lists), under fived's names; fused transformers-5 experts are split back."""
    from safetensors.torch import load_file

    p = Path(hf_dir)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
    if not files:
        raise ConfigError([f"{hf_dir}: no *.safetensors files (only safetensors are read: "
                           "they hold no code)"])
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not (p / f).is_file():
            raise ConfigError([f"{p / f}: listed in the index, missing"])
        for k, v in load_file(str(p / f)).items():
            k = k[len("model."):] if k.startswith("model.") else k
            if k.endswith(FUSED[0]):  # [E, 2F, H] = [w1; w3] per expert
                pre = k[:-len(FUSED[0])] + ".block_sparse_moe.experts."
                w1, w3 = v.chunk(2, dim=1)
                for e in range(v.shape[0]):
                    out[f"{pre}{e}.w1.weight"], out[f"{pre}{e}.w3.weight"] = w1[e], w3[e]
            elif k.endswith(FUSED[1]):  # [E, H, F]
                pre = k[:-len(FUSED[1])] + ".block_sparse_moe.experts."
                for e in range(v.shape[0]):
                    out[f"{pre}{e}.w2.weight"] = v[e]
            elif k.endswith(".mlp.gate.weight"):  # transformers 5's router name
                out[k.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = v
            else:
                out[k] = v
    return out


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, flag: str = "--init-from") -> None:
    """Copy a local HF directory's weights into the whole plain model (every rank, before
    ``parallelize`` cuts it): any layout then holds its pieces."""
    cfg = model_config(read_config(hf_dir, flag), flag, model.cfg.seq_len)
    if replace(cfg, name=model.cfg.name) != replace(model.cfg, name=model.cfg.name):
        raise ConfigError([f"{flag} {hf_dir}: config.json describes {cfg}, the model built is "
                           f"{model.cfg}"])
    tensors = read_tensors(hf_dir)
    if model.cfg.tied_embeddings:
        tensors.pop("lm_head.weight", None)
    params = dict(model.named_parameters())
    bad = [f"{n}: in the checkpoint {tuple(tensors[n].shape)}, model {tuple(p.shape)}"
           for n, p in params.items() if n in tensors and tensors[n].shape != p.shape]
    bad += [f"{n}: missing from {hf_dir}" for n in params if n not in tensors]
    bad += [f"{n}: in {hf_dir}, not in the model" for n in tensors if n not in params]
    if bad:
        raise ConfigError([f"{flag} {hf_dir}: the tensors do not match the model:"] + bad[:40])
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n].to(p.dtype))


def write_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path,
             shard_bytes: int = 2 * 2**30) -> list[tuple[str, int, int]]:
    """config.json + ``model-0000i-of-0000n.safetensors`` shards (≤ ``shard_bytes`` each) +
    ``model.safetensors.index.json``; [(file, tensors, bytes)]."""
    from safetensors.torch import save_file

    dtype = next(iter(tensors.values())).dtype
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    conf = hf_config(cfg, str(dtype).replace("torch.", ""))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][to_hf_name(name)] = t
        size += nb
    n = len(shards)
    weight_map, rows, total = {}, [], 0
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(sh, str(out / fname), metadata={"format": "pt"})
        nb = sum(t.numel() * t.element_size() for t in sh.values())
        total += nb
        rows.append((fname, len(sh), nb))
        weight_map.update({k: fname for k in sh})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=1))
    (out / "config.json").write_text(json.dumps(conf, indent=1))
    return rows
