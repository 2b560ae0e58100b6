"""Hugging Face in and out: ``config.json`` + safetensors <-> fived's model config and tensors.

Families: Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms, a head_dim of its own) dense
models, Mixtral MoE. fived's parameter names *are* Hugging Face's names without the ``model.``
prefix, so the tensor mapping is a rename (``lm_head.weight`` has no prefix; a tied model has
no ``lm_head.weight``):

    fived                                         Hugging Face
    embed_tokens.weight                           model.embed_tokens.weight
    layers.i.self_attn.{q,k,v,o}_proj.weight      model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers.i.self_attn.{q,k,v}_proj.bias          model.layers.i.self_attn.{q,k,v}_proj.bias
    layers.i.self_attn.{q,k}_norm.weight          model.layers.i.self_attn.{q,k}_norm.weight
    layers.i.mlp.{gate,up,down}_proj.weight       model.layers.i.mlp.{gate,up,down}_proj.weight
    layers.i.{input,post_attention}_layernorm.w   model.layers.i.{...}_layernorm.weight
    layers.i.block_sparse_moe.gate.weight         model.layers.i.block_sparse_moe.gate.weight
    layers.i.block_sparse_moe.experts.e.w{1,3,2}  model.layers.i.block_sparse_moe.experts.e.w{1,3,2}
    norm.weight, lm_head.weight                   model.norm.weight, lm_head.weight

Multi-token prediction modules (``mtp_depth`` D) are written under DeepSeek-V3's published
names (its README_WEIGHTS: module k is decoder layer ``num_hidden_layers + k``), with D as
``num_nextn_predict_layers`` in config.json; transformers' classes do not build them and leave
those tensors unused, ``fived import`` and ``--init-from`` read them back:

    mtp.k.{enorm,hnorm,eh_proj}.weight            model.layers.{L+k}.{enorm,hnorm,eh_proj}.weight
    mtp.k.block.X                                 model.layers.{L+k}.X (X as a block's names)
    mtp.k.norm.weight                             model.layers.{L+k}.shared_head.norm.weight
    (the shared embedding and head, copies)       model.layers.{L+k}.embed_tokens.weight,
                                                  model.layers.{L+k}.shared_head.head.weight

Export writes the classic Mixtral expert names (what both transformers 4 and 5 load); import
also reads transformers 5's fused experts (``mlp.experts.gate_up_proj`` = [w1; w3] stacked
over experts, ``mlp.experts.down_proj`` = w2 stacked, ``mlp.gate`` = the router).

The config mapping is exact for what both models compute: RMSNorm in fp32 with
``rms_norm_eps``; RoPE with ``rope_theta``, rotate-half layout; GQA with
``num_key_value_heads``; SwiGLU (``hidden_act = silu``), no MLP biases; Mixtral routing =
softmax in fp32, top-k, renormalised by the top-k sum (fived's ``w = v / Σ v``). The attention
(``attention_fields`` in, ``attention_config`` out, for every family, MoE ones included):
``head_dim`` -> ``head_size`` (0 when it is hidden/heads); Qwen2's q/k/v biases (always on;
Qwen2-MoE: ``qkv_bias``) -> ``qkv_bias``; Qwen3's q/k norms -> ``qk_norm``. Export picks the
family from the fields: a dense model with ``qk_norm`` is Qwen3, with ``qkv_bias`` (no
``qk_norm``) Qwen2, else Llama. What transformers' classes cannot represent is refused with a
ConfigError: a shared expert, other activations, rope scaling, sliding windows, a bias on o_proj
(Llama's and Qwen3's ``attention_bias``, which puts one on all four projections). A fived MoE
trained with ``capacity_factor > 0`` drops tokens over capacity; transformers' Mixtral is
dropless, so export says so (the weights are the same, the forward differs when tokens drop).
"""

from __future__ import annotations

import json
import math
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


FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM"}
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
QK_NORM = ("qwen3", "qwen3_moe")  # families whose attention normalises q and k per head
QKV_BIAS = {"qwen2": True, "qwen2_moe": None}  # always a q/k/v bias | config.json's qkv_bias


def attention_fields(hf: dict[str, Any], flag: str = "--init-from"
                     ) -> tuple[dict[str, Any], list[str]]:
    """fived's attention fields of a Hugging Face config.json (any family: Llama, Mixtral,
    Qwen2/3 and their MoE versions): ({heads, kv_heads, head_size, qk_norm, qkv_bias}, the
    problems fived cannot represent).

    ``head_dim`` (absent: hidden/heads) -> ``head_size``, 0 when it is hidden/heads; Qwen3's
    q/k norms -> ``qk_norm``; Qwen2's q/k/v biases (Qwen2-MoE: ``qkv_bias``) -> ``qkv_bias``.
    ``attention_bias`` (Llama, Qwen3) puts a bias on o_proj as well, which fived has not; a
    sliding window is refused (fived's attention is full causal)."""
    mt = hf.get("model_type")
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    d = hf.get("head_dim") or (h // heads if h % heads == 0 else None)
    problems = []
    if d is None:
        problems.append(f"{flag}: hidden_size {h} is not divisible by num_attention_heads "
                        f"{heads} and config.json gives no head_dim")
    if mt in QKV_BIAS:
        qkv_bias = bool(hf.get("qkv_bias", True)) if QKV_BIAS[mt] is None else True
    else:
        qkv_bias = False
        if hf.get("attention_bias"):
            problems.append(f"{flag}: attention_bias = true puts a bias on o_proj too (fived "
                            "has q/k/v biases only: qkv_bias)")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        problems.append(f"{flag}: sliding-window attention is not supported (full causal "
                        "attention only; use_sliding_window = false)")
    fields = {"heads": heads, "kv_heads": hf.get("num_key_value_heads") or heads,
              "head_size": 0 if d is None or (h % heads == 0 and d == h // heads) else int(d),
              "qk_norm": mt in QK_NORM, "qkv_bias": qkv_bias}
    return fields, problems


def attention_config(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """The attention keys of a config.json of family ``model_type`` for ``cfg``
    (``attention_fields``' inverse; ``check_attention`` says first whether it can hold it)."""
    out: dict[str, Any] = {"num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
                           "head_dim": cfg.head_dim, "attention_dropout": 0.0}
    if model_type in QKV_BIAS:
        if QKV_BIAS[model_type] is None:
            out["qkv_bias"] = cfg.qkv_bias
    else:
        out["attention_bias"] = False
    if model_type.startswith("qwen"):
        out.update({"use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": cfg.layers})
    return out


def check_attention(cfg: ModelConfig, model_type: str) -> list[str]:
    """What family ``model_type`` cannot hold of ``cfg``'s attention (export's refusals)."""
    p = []
    if cfg.qk_norm != (model_type in QK_NORM):
        p.append(f"export: qk_norm = {str(cfg.qk_norm).lower()}; transformers' {model_type} "
                 f"{'always has' if model_type in QK_NORM else 'has no'} q/k norms")
    fixed = QKV_BIAS.get(model_type, False)
    if fixed is not None and cfg.qkv_bias != fixed:
        p.append(f"export: qkv_bias = {str(cfg.qkv_bias).lower()}; transformers' {model_type} "
                 f"{'always has' if fixed else 'has no'} q/k/v biases"
                 + (" (only with o_proj's: attention_bias)" if not fixed else ""))
    return p


def dense_family(cfg: ModelConfig) -> str:
    """The transformers family a dense fived model exports as: Qwen3 with q/k norms, Qwen2
    with q/k/v biases, else Llama."""
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def model_config(hf: dict[str, Any], flag: str = "--init-from", seq_len: int | None = None
                 ) -> ModelConfig:
    """fived's ModelConfig of a Hugging Face Llama / Qwen2 / Qwen3 / Mixtral config.json (a
    ConfigError names what fived cannot represent)."""
    mt = hf.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError([f"{flag}: model_type {mt!r} is another model family; fived reads "
                           + ", ".join(f"{k!r} ({v})" for k, v in FAMILIES.items())])
    if mt == "deepseek_v3":
        return deepseek_config(hf, flag, seq_len)
    h = hf["hidden_size"]
    attn, problems = attention_fields(hf, flag)
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rtype = rope.get("rope_type") or (hf.get("rope_scaling") or {}).get("rope_type") or (
        hf.get("rope_scaling") or {}).get("type") or "default"
    if rtype != "default":
        problems.append(f"{flag}: rope scaling {rtype!r} is not supported (plain RoPE only)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"{flag}: hidden_act {hf.get('hidden_act')!r} (fived's MLP is SwiGLU)")
    if hf.get("mlp_bias"):
        problems.append(f"{flag}: mlp_bias = true: biases in the MLP are not supported")
    if problems:
        raise ConfigError(problems)
    ffn = hf["intermediate_size"]
    cfg = ModelConfig(
        name=f"hf-{mt}", vocab=hf["vocab_size"], hidden=h, layers=hf["num_hidden_layers"],
        ffn=ffn, rope_theta=float(theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mtp_depth=int(hf.get("num_nextn_predict_layers", 0) or 0), **attn)
    if mt == "mixtral":
        cfg = replace(cfg, experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                      moe_ffn=0, shared_expert=False, capacity_factor=0.0,
                      aux_loss_coef=float(hf.get("router_aux_loss_coef", cfg.aux_loss_coef)))
    elif mt in QWEN_MOE:
        cfg = replace(cfg, **qwen_moe_fields(hf, flag))
    if seq_len is not None:
        cfg = replace(cfg, seq_len=seq_len)
    return cfg


def qwen_moe_fields(hf: dict[str, Any], flag: str) -> dict[str, Any]:
    """The MoE fields of a Qwen2-MoE / Qwen3-MoE config.json: ``num_experts`` experts of width
    ``moe_intermediate_size``, top ``num_experts_per_tok``, softmax, ``norm_topk_prob``; the
    dense blocks (``mlp_only_layers``, width ``intermediate_size``) must be the first ones
    (fived's ``first_dense_layers``) and ``decoder_sparse_step`` 1; Qwen2-MoE's shared expert
    (``shared_expert_intermediate_size``) is always sigmoid-gated."""
    mt = hf["model_type"]
    dense = sorted(hf.get("mlp_only_layers") or [])
    problems = []
    if hf.get("decoder_sparse_step", 1) != 1:
        problems.append(f"{flag}: decoder_sparse_step {hf['decoder_sparse_step']}: fived's MoE "
                        "blocks are every block after the first_dense_layers (step 1 only)")
    if dense != list(range(len(dense))):
        problems.append(f"{flag}: mlp_only_layers {dense}: fived's dense blocks must be the "
                        "first ones (first_dense_layers)")
    shared = int(hf.get("shared_expert_intermediate_size", 0)) if mt == "qwen2_moe" else 0
    if mt == "qwen2_moe" and shared <= 0:
        problems.append(f"{flag}: shared_expert_intermediate_size {shared}: a Qwen2-MoE "
                        "without a shared expert still has its gate; fived needs width > 0")
    if problems:
        raise ConfigError(problems)
    return dict(experts=hf.get("num_experts", hf.get("num_local_experts")),
                top_k=hf["num_experts_per_tok"],
                moe_ffn=hf["moe_intermediate_size"], router="softmax",
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), capacity_factor=0.0,
                first_dense_layers=len(dense), shared_expert=shared > 0,
                shared_expert_ffn=shared, shared_expert_gate=shared > 0,
                aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def moe_family(cfg: ModelConfig) -> str:
    """The transformers family a fived MoE exports as: Qwen3-MoE with q/k norms, Qwen2-MoE with
    a shared expert, else Mixtral."""
    return "qwen3_moe" if cfg.qk_norm else "qwen2_moe" if cfg.shared_expert else "mixtral"


def _check_moe(cfg: ModelConfig, mt: str) -> list[str]:
    """What family ``mt`` cannot hold of ``cfg``'s MoE (export's refusals)."""
    have = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE"}[mt]
    want = [("router", "softmax"), ("balance", "aux_loss"), ("route_groups", 0)]
    if mt == "mixtral":
        want += [("norm_topk_prob", True), ("first_dense_layers", 0), ("shared_expert", False)]
    elif mt == "qwen3_moe":
        want += [("shared_expert", False)]
    else:
        want += [("shared_expert_gate", True)]
    return [f"export: {f} = {getattr(cfg, f)!r}; transformers' {have} has only {f} = {w!r}"
            for f, w in want if getattr(cfg, f) != w]


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The config.json transformers loads as LlamaForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM (``dense_family``) or MixtralForCausalLM."""
    if cfg.is_mla:
        return deepseek_hf_config(cfg, dtype)
    problems = [f"export: {f} = {getattr(cfg, f)!r}: only DeepSeek-V3's MLA models carry it "
                "(kv_lora_rank > 0)" for f, d in (("rope_factor", 1.0),
                                                  ("routed_scaling_factor", 1.0))
                if getattr(cfg, f) != d]
    if problems:
        raise ConfigError(problems)
    mt = moe_family(cfg) if cfg.is_moe else dense_family(cfg)
    problems = check_attention(cfg, mt) + (_check_moe(cfg, mt) if cfg.is_moe else [])
    if problems:
        raise ConfigError(problems)
    out: dict[str, Any] = {
        "architectures": [FAMILIES[mt]], "model_type": mt,
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden,
        "intermediate_size": cfg.expert_ffn if mt == "mixtral" else cfg.ffn,
        "num_hidden_layers": cfg.layers, **attention_config(cfg, mt), "hidden_act": "silu",
        "max_position_embeddings": max(cfg.seq_len, 2048), "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tied_embeddings,
        "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,
    }
    if cfg.mtp_depth:  # DeepSeek-V3's field (transformers' classes keep it, build nothing)
        out["num_nextn_predict_layers"] = cfg.mtp_depth
    if mt == "mixtral":
        out.update({"num_local_experts": cfg.experts, "num_experts_per_tok": cfg.top_k,
                    "router_aux_loss_coef": cfg.aux_loss_coef, "output_router_logits": False,
                    "router_jitter_noise": 0.0, "sliding_window": None})
    elif mt in QWEN_MOE:
        out.update({"num_experts": cfg.experts, "num_experts_per_tok": cfg.top_k,
                    "moe_intermediate_size": cfg.expert_ffn, "norm_topk_prob": cfg.norm_topk_prob,
                    "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.first_dense_layers)),
                    "router_aux_loss_coef": cfg.aux_loss_coef, "output_router_logits": False})
        if mt == "qwen2_moe":
            out["shared_expert_intermediate_size"] = cfg.shared_ffn
    elif mt == "llama":
        out["mlp_bias"] = False
    return out


# ------------------------------------------------------------------ tensors
# fived's MoE names -> Qwen-MoE's (Hugging Face's per-expert checkpoint names)
QWEN_NAMES = ((".block_sparse_moe.experts.", ".mlp.experts."), (".w1.weight", ".gate_proj.weight"),
              (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight"),
              (".block_sparse_moe.", ".mlp."))


MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
           "eh_proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight",
           "embed_tokens.weight": "embed_tokens.weight",  # the two shared copies (export only)
           "shared_head.head.weight": "shared_head.head.weight"}


def mtp_aliases(cfg: ModelConfig) -> dict[str, str]:
    """The shared tensors DeepSeek's files repeat in each MTP layer: alias -> fived's name."""
    head = "embed_tokens.weight" if cfg.tied_embeddings else "lm_head.weight"
    return {a: src for k in range(cfg.mtp_depth)
            for a, src in ((f"mtp.{k}.embed_tokens.weight", "embed_tokens.weight"),
                           (f"mtp.{k}.shared_head.head.weight", head))}


def mtp_to_layer(name: str, layers: int) -> str:
    """``mtp.k.…`` -> DeepSeek's ``layers.{layers+k}.…`` (other names unchanged)."""
    if not name.startswith("mtp."):
        return name
    _, k, rest = name.split(".", 2)
    pre = f"layers.{layers + int(k)}."
    return pre + (rest[len("block."):] if rest.startswith("block.") else MTP_OWN[rest])


def mtp_from_layer(k: str, layers: int, depth: int) -> str | None:
    """``layers.{j}.…`` with layers <= j < layers + depth -> fived's ``mtp.{j−layers}.…``; the
    key unchanged for a trunk name; None for a shared copy (the embedding, the head)."""
    parts = k.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or not layers <= int(parts[1]) < layers + depth:
        return k
    j, rest = int(parts[1]) - layers, parts[2]
    if rest in ("embed_tokens.weight", "shared_head.head.weight"):
        return None
    own = {v: a for a, v in MTP_OWN.items()}
    return f"mtp.{j}.{own[rest]}" if rest in own else f"mtp.{j}.block.{rest}"


def to_hf_name(name: str, family: str = "llama", layers: int = 0) -> str:
    """fived's name -> the HF key (``model.`` prefix; Qwen-MoE's ``mlp.`` names for ``family``
    qwen2_moe / qwen3_moe: ``mlp.gate``, ``mlp.experts.e.{gate,up,down}_proj``,
    ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``; DeepSeek-V3's own names; an MTP
    module's under DeepSeek's ``layers.{layers+k}``)."""
    name = mtp_to_layer(name, layers)
    if family == "deepseek_v3":
        return deepseek_name(name)
    if family in QWEN_MOE and ".block_sparse_moe." in name:
        for a, b in QWEN_NAMES if ".experts." in name else QWEN_NAMES[-1:]:
            name = name.replace(a, b)
    return name if name == "lm_head.weight" else f"model.{name}"


def from_qwen_moe_name(k: str) -> str:
    """A Qwen-MoE key (``model.`` removed) -> fived's name (``to_hf_name``'s inverse); other
    keys unchanged. A dense block's ``mlp.{gate,up,down}_proj`` stays."""
    if ".mlp.experts." in k:
        for b, a in QWEN_NAMES:
            k = k.replace(a, b)
    elif ".mlp.shared_expert" in k or k.endswith(".mlp.gate.weight"):
        k = k.replace(".mlp.", ".block_sparse_moe.")
    return k


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape (a model on the meta device: nothing allocated)."""
    from ..model.llama import Transformer

    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}


def hf_files(hf_dir: str | Path, flag: str = "--init-from") -> list[Path]:
    """The safetensors files of a local HF directory: those its index lists, or every one."""
    p = Path(hf_dir)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise ConfigError([f"{flag} {index}: not a safetensors index ({e})"]) from None
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
    if not files:
        raise ConfigError([f"{flag} {hf_dir}: no *.safetensors files (only safetensors are "
                           "read: they hold no code)"])
    missing = [f for f in files if not (p / f).is_file()]
    if missing:
        raise ConfigError([f"{flag} {p / f}: listed in {index.name}, missing" for f in missing])
    return [p / f for f in files]


class HFSource:
    """A local HF directory read lazily, piece by piece (safetensors' ``get_slice``).

    ``tensors`` maps each fived name to (file, HF key, leading selector, global shape): only
    the headers are read to build it. ``fill(out, name, shape, dim, parts, index)`` reads chunk
    ``index`` of ``parts`` along ``dim`` (the rank's piece, ``fived.parallel.placement``)
    straight into ``out`` in row blocks of at most ``BLOCK`` elements; each file is mapped only
    while one tensor is read (its pages count in the resident set while mapped), so a rank holds
    its own piece and at most one tensor's pages of the file; transformers 5's fused experts are
    sliced out of the stacked tensor the same way."""

    BLOCK = 1 << 22

    def __init__(self, hf_dir: str | Path, cfg: ModelConfig | None = None,
                 flag: str = "--init-from"):
        from safetensors import safe_open

        self.dir, self.flag = Path(hf_dir), flag
        conf = self.dir / "config.json"
        hfc = json.loads(conf.read_text()) if conf.is_file() else {}
        # DeepSeek's rotary rows are interleaved pairs: read as halves (``interleave_rope``)
        self.interleaved = hfc.get("model_type") == "deepseek_v3" and \
            hfc.get("rope_interleave", True)
        self.cfg = cfg
        self.tensors: dict[str, tuple[Path, str, tuple, tuple[int, ...]]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.buffers: dict[str, tuple[Path, str, tuple, tuple[int, ...]]] = {}
        for f in hf_files(hf_dir, flag):
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        sl = h.get_slice(k)
                        self._index(f, k, tuple(sl.get_shape()))
                        self.dtypes[k] = _dtype(sl.get_dtype())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own errors
                raise ConfigError([f"{flag} {f}: not a safetensors file ({e})"]) from None
        if cfg is not None and cfg.mtp_depth:  # DeepSeek's MTP layers -> mtp.k
            moved = {mtp_from_layer(k, cfg.layers, cfg.mtp_depth): v
                     for k, v in self.tensors.items()}
            self.tensors = {k: v for k, v in moved.items() if k is not None}
        if cfg is not None:
            self.check(cfg)

    def _index(self, f: Path, key: str, shape: tuple[int, ...]) -> None:
        k = key[len("model."):] if key.startswith("model.") else key
        if k.endswith(FUSED[0]):  # [E, 2F, H] = [w1; w3] per expert
            pre = k[:-len(FUSED[0])] + ".block_sparse_moe.experts."
            E, F2, H = shape
            for e in range(E):
                self.tensors[f"{pre}{e}.w1.weight"] = (f, key, (e, 0), (F2 // 2, H))
                self.tensors[f"{pre}{e}.w3.weight"] = (f, key, (e, F2 // 2), (F2 // 2, H))
        elif k.endswith(FUSED[1]):  # [E, H, F]
            pre = k[:-len(FUSED[1])] + ".block_sparse_moe.experts."
            for e in range(shape[0]):
                self.tensors[f"{pre}{e}.w2.weight"] = (f, key, (e, 0), tuple(shape[1:]))
        elif k.endswith(".mlp.gate.e_score_correction_bias"):  # DeepSeek-V3's selection bias
            self.buffers[k[:-len(".mlp.gate.e_score_correction_bias")]
                         + ".block_sparse_moe.route_bias"] = (f, key, (), shape)
        elif ".mlp.shared_experts." in k:  # DeepSeek-V3's shared expert(s)
            self.tensors[k.replace(".mlp.shared_experts.", ".block_sparse_moe.shared_expert.")
                         ] = (f, key, (), shape)
        elif ".mlp.experts." in k or ".mlp.shared_expert" in k or k.endswith(".mlp.gate.weight"):
            # Qwen-MoE's per-expert names (and transformers 5's router name, Mixtral's too)
            self.tensors[from_qwen_moe_name(k)] = (f, key, (), shape)
        else:
            self.tensors[k] = (f, key, (), shape)

    def check(self, cfg: ModelConfig) -> None:
        """Every parameter of ``cfg`` present with its shape, nothing else (a ConfigError
        naming the file and the tensor of each mismatch)."""
        shapes = param_shapes(cfg)
        have = {n: t for n, t in self.tensors.items()
                if not (cfg.tied_embeddings and n == "lm_head.weight")}
        bad = [f"{n}: {have[n][3]} in {have[n][0].name} ({have[n][1]}), the model needs {s}"
               for n, s in shapes.items() if n in have and tuple(have[n][3]) != tuple(s)]
        bad += [f"{n}: missing from {self.dir}" for n in shapes if n not in have]
        bad += [f"{n}: in {have[n][0].name}, not in the model" for n in have if n not in shapes]
        if bad:
            raise ConfigError([f"{self.flag} {self.dir}: the tensors do not match the model:"]
                              + bad[:40])

    @torch.no_grad()
    def fill(self, out: torch.Tensor, name: str, shape: tuple[int, ...], dim: int = 0,
             parts: int = 1, index: int = 0) -> torch.Tensor:
        from safetensors import safe_open

        f, key, lead, _ = self.tensors[name]
        with safe_open(str(f), framework="pt") as h:  # mapped for this tensor only: unmapped
            self._fill(h.get_slice(key), out, lead, shape, dim, parts, index)  # after
        if self.interleaved and self.cfg is not None and (dim == 0 or parts == 1):
            out.copy_(interleave_rope(name, out, self.cfg))
        return out

    def buffer(self, name: str) -> torch.Tensor | None:
        """Buffer ``name`` whole (DeepSeek-V3's ``e_score_correction_bias`` as fived's
        ``route_bias``, fp32); None when the files have none."""
        from safetensors import safe_open

        if name not in self.buffers:
            return None
        f, key, _, _ = self.buffers[name]
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(key).float()

    def _fill(self, sl: Any, out: torch.Tensor, lead: tuple, shape: tuple[int, ...], dim: int,
              parts: int, index: int) -> torch.Tensor:
        from ..model.init import piece_box

        box = list(piece_box(tuple(shape), dim, parts, index))
        if lead:  # a fused expert: its index, and its row offset inside [w1; w3]
            off = lead[1]
            box[0] = (box[0][0] + off, box[0][1] + off)
        dest = out.view([b - a for a, b in box])
        r0, r1 = box[0]
        row = max(1, math.prod(b - a for a, b in box[1:]))
        step = max(1, self.BLOCK // row)
        rest = tuple(slice(a, b) for a, b in box[1:])
        for r in range(r0, r1, step):
            sel = (slice(r, min(r + step, r1)),) + rest
            dest[r - r0:min(r + step, r1) - r0].copy_(sl[(lead[0],) + sel if lead else sel])
        return out

    def read(self, name: str) -> torch.Tensor:
        """One whole tensor (``fived import`` streams them one at a time)."""
        f, key, lead, shape = self.tensors[name]
        out = torch.empty(shape, dtype=self.dtypes[key])
        return self.fill(out, name, shape)


def _dtype(st: str) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
            "F64": torch.float64}[st]


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, flag: str = "--init-from") -> None:
    """Read a local HF directory's weights into a whole plain model, tensor by tensor."""
    cfg = model_config(read_config(hf_dir, flag), flag, model.cfg.seq_len)
    if replace(cfg, name=model.cfg.name) != replace(model.cfg, name=model.cfg.name):
        raise ConfigError([f"{flag} {hf_dir}: config.json describes {cfg}, the model built is "
                           f"{model.cfg}"])
    src = HFSource(hf_dir, model.cfg, flag)
    for n, p in model.named_parameters():
        src.fill(p.data, n, tuple(p.shape))
    for n, b in model.named_buffers():
        saved = src.buffer(n)
        if saved is not None:
            b.copy_(saved)


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names (sorted) grouped into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes):
        if shards[-1] and size + sizes[name] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def family(cfg: ModelConfig) -> str:
    """The transformers ``model_type`` ``cfg`` exports as."""
    if cfg.is_mla:
        return "deepseek_v3"
    return moe_family(cfg) if cfg.is_moe else dense_family(cfg)


def write_shard(tensors: dict[str, torch.Tensor], out: Path, i: int, n: int,
                cfg: ModelConfig) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    fam = family(cfg)
    if fam == "deepseek_v3":
        tensors = {k: interleave_rope(k, t, cfg, inverse=True) for k, t in tensors.items()}
    save_file({to_hf_name(k, fam, cfg.layers): t.contiguous() for k, t in tensors.items()},
              str(out / shard_name(i, n)), metadata={"format": "pt"})


def write_index(shards: list[list[str]], sizes: dict[str, int], cfg: ModelConfig, out: Path,
                dtype: str) -> list[tuple[str, int, int]]:
    """``model.safetensors.index.json`` and ``config.json``; [(file, tensors, bytes)]."""
    weight_map, rows = {}, []
    for i, names in enumerate(shards):
        fname = shard_name(i, len(shards))
        rows.append((fname, len(names), sum(sizes[k] for k in names)))
        weight_map.update({to_hf_name(k, family(cfg), cfg.layers): fname for k in names})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(sizes.values())},
         "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=1))
    return rows


# ------------------------------------------------------------------ DeepSeek-V3 (MLA)
def _rope_rows(r: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rows (..., d_r, cols) of a rotary block: interleaved pairs (x0, x1), (x2, x3) ... ->
    halves (x0, x2, ... | x1, x3, ...), or back with ``inverse``."""
    if not inverse:
        return torch.cat([r[..., 0::2, :], r[..., 1::2, :]], dim=-2)
    out = torch.empty_like(r)
    half = r.shape[-2] // 2
    out[..., 0::2, :], out[..., 1::2, :] = r[..., :half, :], r[..., half:, :]
    return out


def interleave_rope(name: str, t: torch.Tensor, cfg: ModelConfig, inverse: bool = False
                    ) -> torch.Tensor:
    """DeepSeek's checkpoints rotate interleaved pairs; fived rotates halves (``apply_rope``).
    Permuting the rotary rows of the query projection (every head's last d_r rows) and of
    ``kv_a_proj_with_mqa`` (its last d_r rows) the same way leaves every score unchanged;
    ``inverse`` permutes back for export. Other tensors are returned as they are."""
    dr = cfg.qk_rope_head_dim
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        dq = cfg.qk_head_dim
        w = t.reshape(-1, dq, t.shape[-1])
        rot = _rope_rows(w[:, dq - dr:], inverse)
        return torch.cat([w[:, :dq - dr], rot], dim=1).reshape(t.shape)
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        return torch.cat([t[:-dr], _rope_rows(t[-dr:], inverse)])
    return t


def deepseek_name(name: str) -> str:
    """fived's name -> DeepSeek-V3's published key (``model.`` prefix; ``mlp.gate``,
    ``mlp.experts.e.{gate,up,down}_proj``, ``mlp.shared_experts.*``,
    ``mlp.gate.e_score_correction_bias`` for the selection bias ``route_bias``)."""
    if name.endswith(".block_sparse_moe.route_bias"):
        name = name.replace(".block_sparse_moe.route_bias", ".mlp.gate.e_score_correction_bias")
    elif ".block_sparse_moe.shared_expert." in name:
        name = name.replace(".block_sparse_moe.shared_expert.", ".mlp.shared_experts.")
    elif ".block_sparse_moe." in name:
        for a, b in QWEN_NAMES if ".experts." in name else QWEN_NAMES[-1:]:
            name = name.replace(a, b)
    return name if name == "lm_head.weight" else f"model.{name}"


def _rope_fields(hf: dict[str, Any], flag: str) -> tuple[dict[str, Any], list[str]]:
    """rope_theta and YaRN's fields of a config.json (``rope_parameters``, transformers 5, or
    ``rope_scaling``, DeepSeek's own files)."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    out = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        return out, []
    if kind != "yarn":
        return out, [f"{flag}: rope scaling {kind!r} is not supported (plain RoPE or yarn)"]
    if rope.get("attention_factor") is not None:
        return out, [f"{flag}: yarn's attention_factor is not supported (fived derives the "
                     "gain from factor, mscale and mscale_all_dim)"]
    original = rope.get("original_max_position_embeddings") or 4096
    factor = rope.get("factor") or hf.get("max_position_embeddings", original) / original
    out.update(rope_factor=float(factor), rope_original_max_positions=int(original),
               rope_beta_fast=float(rope.get("beta_fast") or 32),
               rope_beta_slow=float(rope.get("beta_slow") or 1),
               rope_mscale=float(rope.get("mscale") or 0.0),
               rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    if not rope.get("truncate", True):
        return out, [f"{flag}: yarn with truncate = false is not supported"]
    return out, []


def deepseek_config(hf: dict[str, Any], flag: str = "--init-from", seq_len: int | None = None
                    ) -> ModelConfig:
    """fived's ModelConfig of a DeepSeek-V3 config.json (Kimi K2's too: the same
    architecture): MLA, YaRN, sigmoid routing with the selection bias over ``n_group`` groups
    (best ``topk_group``), ``n_shared_experts`` shared experts as one of their summed width,
    the first ``first_k_dense_replace`` blocks dense, ``routed_scaling_factor``."""
    rope, problems = _rope_fields(hf, flag)
    heads = hf["num_attention_heads"]
    if hf.get("attention_bias"):
        problems.append(f"{flag}: attention_bias = true is not supported (MLA without biases)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"{flag}: hidden_act {hf.get('hidden_act')!r} (fived's MLP is SwiGLU)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"{flag}: scoring_func {hf['scoring_func']!r} (DeepSeek-V3 routes by "
                        "sigmoid; fived reads only that)")
    shared = int(hf.get("n_shared_experts") or 0)
    if shared < 1:
        problems.append(f"{flag}: n_shared_experts {shared}: transformers' DeepSeek-V3 always "
                        "builds its shared expert; fived needs at least 1")
    groups, top_groups = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if problems:
        raise ConfigError(problems)
    moe_ffn = hf["moe_intermediate_size"]
    cfg = ModelConfig(
        name="hf-deepseek_v3", vocab=hf["vocab_size"], hidden=hf["hidden_size"],
        layers=hf["num_hidden_layers"], heads=heads, kv_heads=heads,
        ffn=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], **rope,
        experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], moe_ffn=moe_ffn,
        shared_expert=True, shared_expert_ffn=moe_ffn * shared, router="sigmoid",
        balance="bias", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        route_groups=groups if groups > 1 else 0, route_top_groups=top_groups if groups > 1 else 0,
        first_dense_layers=int(hf.get("first_k_dense_replace") or 0),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        aux_loss_coef=float(hf.get("aux_loss_alpha", 0.0001)), z_loss_coef=0.0,
        capacity_factor=0.0)
    return cfg if seq_len is None else replace(cfg, seq_len=seq_len)


def deepseek_hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The config.json transformers loads as ``DeepseekV3ForCausalLM`` (``deepseek_config``'s
    inverse; its refusals name what the class cannot hold)."""
    want = [("router", "sigmoid"), ("shared_expert_gate", False), ("qk_norm", False),
            ("qkv_bias", False), ("capacity_factor", 0.0)]
    problems = [f"export: {f} = {getattr(cfg, f)!r}; transformers' DeepSeek-V3 has only "
                f"{f} = {w!r}" for f, w in want if getattr(cfg, f) != w]
    if not cfg.is_moe or not cfg.shared_expert or cfg.shared_ffn % cfg.expert_ffn:
        problems.append("export: an MLA model exports as DeepSeek-V3, a MoE with shared "
                        "experts whose width is a multiple of the experts' (experts > 0, "
                        "shared_expert = true)")
    if problems:
        raise ConfigError(problems)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.yarn:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_max_positions,
                "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}
    return {
        "architectures": [FAMILIES["deepseek_v3"]], "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
        "moe_intermediate_size": cfg.expert_ffn, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.heads,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "rope_interleave": True, "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu",
        "n_routed_experts": cfg.experts, "num_experts_per_tok": cfg.top_k,
        "n_shared_experts": cfg.shared_ffn // cfg.expert_ffn,
        "n_group": cfg.route_groups or 1, "topk_group": cfg.route_top_groups or 1,
        "norm_topk_prob": cfg.norm_topk_prob, "routed_scaling_factor": cfg.routed_scaling_factor,
        "first_k_dense_replace": cfg.first_dense_layers, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "aux_loss_alpha": cfg.aux_loss_coef,
        "num_nextn_predict_layers": cfg.mtp_depth,
        "max_position_embeddings": max(cfg.seq_len, 2048), "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "tie_word_embeddings": cfg.tied_embeddings, "initializer_range": 0.02,
        "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
    }
