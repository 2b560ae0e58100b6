"""Configs: the model, the layout and the run, plus presets, validation and TOML.

Three dataclasses describe everything fived needs:

* ``ModelConfig``  — the shape of a Llama-style decoder (optionally MoE).
* ``ParallelConfig`` — the layout ``pp × dp × ep × cp × tp`` and how each dimension runs.
* ``TrainConfig``  — the optimisation run (steps, global batch, learning rate, seed ...).

Each field carries its own help text and bounds (``field.metadata``): the command line builds
every flag from them (``fived.ui.flags``), so ``fived train``, ``fived ledger``, ``fived plan``
and the benchmarks share one flag set with the dataclass defaults, and ``validate`` checks the
same bounds whether a value came from a flag, a TOML file or Python.

``validate`` checks every constraint at once and raises one ``ConfigError`` that lists each
broken constraint with a suggested fix, so a bad layout is rejected before any process starts.
``fill_dp`` gives data parallelism the ranks the other degrees leave. ``check_outputs`` checks
that the files a run will write can be written. The ledger imports this module only: it must
stay free of torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration: ``problems`` lists each broken constraint and its fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
V_SCHEDULES = ("zb-v", "dualpipe-v")  # two stages per rank in a V: rank r holds r and 2pp−1−r
PRECISIONS = ("fp32", "bf16", "fp16")
AUTO = "auto"  # --precision auto (the default): resolved once, by ``resolve_precision``
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
RECOMPUTE = ("none", "selective", "full")
CP_MODES = ("ring", "ulysses", "ring-latent")
EP_DISPATCHES = ("rows", "tokens")  # one row per (token, expert) | per (token, ep rank)
COLLECTIVES = ("backend", "ring")
ZERO_ALIGN = ("none", "rows")
OPTIMIZERS = ("adamw", "adafactor", "muon", "rownorm")
MASTER_WEIGHTS = ("fp32", "none", "sr", "kahan")
FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise")  # fived.model.fp8
MLPS = ("swiglu", "gelu")  # Llama's gated MLP (3 matrices) | GPT's (2 matrices)
POSITIONS = ("rope", "learned")  # rotary | a learned position table (GPT)
NORMS = ("rmsnorm", "layernorm")  # gain only | gain and bias (GPT)
ROUTERS = ("softmax", "sigmoid")  # MoE routing scores
BALANCES = ("aux_loss", "bias")  # MoE load balancing: the balance loss | loss-free bias
EXPERT_MATMULS = ("auto", "grouped", "loop")  # a rank's experts: fived.model.grouped | a loop
DIMS = ("pp", "dp", "ep", "cp", "tp")  # outermost ... innermost (the default grid order)
DEFAULT_WORLD = 4  # ranks `fived train` starts when nothing says otherwise


def spec(default: Any, help: str, *, flag: str | None = None, ge: float | None = None,
         gt: float | None = None, lt: float | None = None, le: float | None = None,
         choices: tuple | None = None, metavar: str | None = None, shown: str | None = None) -> Any:
    """A dataclass field with what the command line and ``validate`` need to know about it.

    ``flag``: the option's name ("" for a TOML-only field; default ``--field-name``);
    ``ge``/``gt``/``lt``/``le``: bounds; ``choices``: the allowed values; ``shown``: the
    default as --help words it, where the value alone would mislead."""
    meta = {"help": help, "flag": flag, "ge": ge, "gt": gt, "lt": lt, "le": le,
            "choices": choices, "metavar": metavar, "shown": shown}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    name: str = spec("tiny", "preset the shape starts from", flag="")
    vocab: int = spec(256, "vocabulary size", flag="", ge=1)
    hidden: int = spec(64, "model width", flag="", ge=1)
    layers: int = spec(4, "transformer blocks", flag="", ge=1)
    heads: int = spec(4, "attention heads", flag="", ge=1)
    kv_heads: int = spec(2, "key/value heads (GQA)", flag="", ge=1)
    ffn: int = spec(176, "MLP width", flag="", ge=1)
    seq_len: int = spec(64, "tokens per sequence", ge=1, shown="the preset's; tiny: 64")
    rope_theta: float = spec(10000.0, "RoPE base", flag="", gt=0)
    tied_embeddings: bool = spec(False, "share the embedding and the output head", flag="")
    norm_eps: float = spec(1e-5, "RMSNorm epsilon", flag="", gt=0)
    # Multi-token prediction (DeepSeek-V3 §2.2; fived.model.mtp): D sequential modules after
    # the trunk, module k predicting token i+1+k; loss = trunk + λ/D · Σ_k module k's
    mtp_depth: int = spec(0, "multi-token prediction modules D after the trunk (0: none; "
                             "DeepSeek-V3: 1), module k predicting the token k+1 ahead", ge=0)
    mtp_loss_weight: float = spec(0.3, "λ: the loss is the trunk's + λ·(mean of the D "
                                       "modules' losses) (DeepSeek-V3: 0.3, then 0.1)", ge=0)
    # Attention shapes (Qwen): heads·head_dim may differ from hidden (``head_dim``)
    head_size: int = spec(0, "width of one attention head (0: hidden/heads; Hugging Face's "
                             "head_dim, e.g. 128 for Qwen3-30B-A3B's hidden 2048, 32 heads)",
                          flag="", ge=0)
    qk_norm: bool = spec(False, "an RMSNorm over each head of q and k, after the projections and "
                                "before RoPE (Qwen3: self_attn.{q,k}_norm)", flag="")
    qkv_bias: bool = spec(False, "a bias on the q, k and v projections, none on o (Qwen2)",
                          flag="")
    # Multi-head latent attention (DeepSeek-V2/V3, fived.model.mla): kv_lora_rank > 0 turns it
    # on; heads then have q/k width qk_nope_head_dim + qk_rope_head_dim and v width v_head_dim
    q_lora_rank: int = spec(0, "MLA: the query's latent width (0: a plain query projection; "
                               "DeepSeek-V3: 1536)", flag="", ge=0)
    kv_lora_rank: int = spec(0, "MLA: the joint key/value latent width (0: no MLA, grouped-query "
                                "attention; DeepSeek-V3: 512)", flag="", ge=0)
    qk_nope_head_dim: int = spec(0, "MLA: the per-head query/key width without RoPE "
                                    "(DeepSeek-V3: 128)", flag="", ge=0)
    qk_rope_head_dim: int = spec(0, "MLA: the rotary query/key width, the rotary key shared by "
                                    "all heads (DeepSeek-V3: 64)", flag="", ge=0)
    v_head_dim: int = spec(0, "MLA: the per-head value width (DeepSeek-V3: 128)", flag="", ge=0)
    # YaRN rope scaling (Peng et al. 2023; DeepSeek-V3's rope_scaling): factor 1 = plain RoPE
    rope_factor: float = spec(1.0, "YaRN: the context extension factor (1: plain RoPE; "
                                   "DeepSeek-V3: 40)", flag="", ge=1)
    rope_original_max_positions: int = spec(4096, "YaRN: the pre-training context length "
                                                  "(original_max_position_embeddings)",
                                            flag="", ge=1)
    rope_beta_fast: float = spec(32.0, "YaRN: rotations above which a frequency is kept "
                                       "(beta_fast)", flag="", gt=0)
    rope_beta_slow: float = spec(1.0, "YaRN: rotations below which a frequency is interpolated "
                                      "(beta_slow)", flag="", gt=0)
    rope_mscale: float = spec(1.0, "YaRN: mscale, the cos/sin gain's numerator 0.1·m·ln f + 1",
                              flag="", ge=0)
    rope_mscale_all_dim: float = spec(0.0, "YaRN: mscale_all_dim, the gain's denominator and "
                                           "the softmax scale's (0.1·m·ln f + 1)² (0: none)",
                                      flag="", ge=0)
    routed_scaling_factor: float = spec(1.0, "MoE: the routed experts' weights times this "
                                             "(DeepSeek-V3: 2.5)", flag="", gt=0)
    # Mixture of experts: experts == 0 means a dense model.
    experts: int = spec(0, "experts per MoE layer (0: dense)", flag="", ge=0)
    top_k: int = spec(2, "experts each token is routed to", flag="", ge=1)
    moe_ffn: int = spec(0, "expert MLP width (0: same as ffn)", flag="", ge=0)
    shared_expert: bool = spec(False, "one expert every token also runs", flag="")
    shared_expert_ffn: int = spec(0, "the shared expert's width (0: the experts' width; "
                                     "DeepSeek-MoE's 2 shared experts = one of twice the width)",
                                  flag="", ge=0)
    shared_expert_gate: bool = spec(False, "scale the shared expert's output by a learned "
                                           "per-token sigmoid gate σ(w·x) (Qwen2-MoE)", flag="")
    capacity_factor: float = spec(0.0, "expert capacity factor (0: dropless)", flag="", ge=0)
    expert_matmul: str = spec("auto", "a rank's experts: grouped (three grouped matmuls over the "
                                      "rows sorted by expert, torch._grouped_mm), loop (one "
                                      "Expert module per expert) or auto (grouped where "
                                      "torch._grouped_mm runs for the device, dtype and widths, "
                                      "else loop)", flag="", choices=EXPERT_MATMULS)
    aux_loss_coef: float = spec(0.01, "load-balancing loss weight (with balance = bias: the "
                                      "complementary sequence-wise loss, 0 for none)", flag="",
                                ge=0)
    z_loss_coef: float = spec(0.001, "router z-loss weight", flag="", ge=0)
    norm_topk_prob: bool = spec(True, "renormalise the top-k routing weights to sum to 1 "
                                      "(false: use the scores as they are, Qwen2-MoE)", flag="")
    router: str = spec("softmax", "routing scores: softmax (Mixtral, Qwen) or sigmoid "
                                  "(DeepSeek-V3)", flag="", choices=ROUTERS)
    route_groups: int = spec(0, "node-limited routing: the experts form this many contiguous "
                                "groups (0: no groups)", flag="", ge=0)
    route_top_groups: int = spec(0, "node-limited routing: each token picks experts from its "
                                    "best this-many groups only", flag="", ge=0)
    first_dense_layers: int = spec(0, "the first N blocks use a dense MLP (width ffn) instead "
                                      "of the MoE (DeepSeek-MoE)", flag="", ge=0)
    balance: str = spec("aux_loss", "load balancing: aux_loss (the balance loss) or bias "
                                    "(loss-free, DeepSeek-V3: a per-expert selection bias)",
                        flag="", choices=BALANCES)
    bias_update_rate: float = spec(0.001, "balance = bias: the bias step γ per optimizer step "
                                          "(b_e += γ·sign(mean load − load_e))", flag="", ge=0)
    # GPT-style shapes: the ledger describes them (exact parameter counts, FLOPs, time); the
    # runtime trains the Llama-style defaults only (``check_runtime_model``). Multi-head vs
    # grouped-query attention is kv_heads == heads vs fewer.
    mlp: str = spec("swiglu", "MLP: swiglu (gate, up, down: Llama) or gelu (up, down: GPT)",
                    choices=MLPS)
    positions: str = spec("rope", "positions: rope (rotary) or learned (a seq_len × hidden "
                                  "table, GPT)", choices=POSITIONS)
    norm: str = spec("rmsnorm", "norms: rmsnorm (gain) or layernorm (gain and bias, GPT)",
                     choices=NORMS)
    bias: bool = spec(False, "a bias on every linear layer but the head (GPT)")

    @property
    def head_dim(self) -> int:
        """One head's width: ``head_size``, or hidden/heads when it is 0."""
        return self.head_size or self.hidden // self.heads

    @property
    def attn_dim(self) -> int:
        """The attention output's width, o_proj's input: heads·head_dim (hidden unless
        ``head_size`` says otherwise; q's width too), heads·v_head_dim with MLA."""
        return self.heads * (self.v_head_dim if self.kv_lora_rank > 0 else self.head_dim)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` > 0)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """One head's query/key width: qk_nope + qk_rope with MLA, else head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """One head's value (and attention output) width: v_head_dim with MLA, else head_dim."""
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The rotated width of a query/key head: qk_rope_head_dim with MLA, else head_dim."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def yarn(self) -> bool:
        return self.rope_factor != 1.0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    @property
    def shared_ffn(self) -> int:
        """The shared expert's width (0 without one)."""
        return (self.shared_expert_ffn or self.expert_ffn) if self.shared_expert else 0

    @property
    def node_limited(self) -> bool:
        """Routing limited to ``route_top_groups`` of ``route_groups`` expert groups."""
        return self.route_groups > 1 and 0 < self.route_top_groups < self.route_groups

    @property
    def moe_layers(self) -> int:
        """Blocks with a MoE feed-forward (the first ``first_dense_layers`` are dense)."""
        return max(self.layers - self.first_dense_layers, 0) if self.is_moe else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_dense_layers


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "tiny-moe": ModelConfig(name="tiny-moe", ffn=96, experts=4, top_k=2),
    # Qwen3-MoE's routing (softmax, top-k renormalised) on tiny shapes, for tests
    "qwen3-moe-tiny": ModelConfig(name="qwen3-moe-tiny", ffn=96, moe_ffn=32, experts=8,
                                  top_k=4, norm_topk_prob=True, router="softmax"),
    # DeepSeek-V3's shapes on tiny widths, for tests: MLA with query compression and YaRN,
    # sigmoid routing over 4 groups (best 2) with the selection bias, a shared expert of twice
    # the experts' width, the first block dense, routed scaling
    "deepseek-v3-tiny": ModelConfig(
        name="deepseek-v3-tiny", hidden=32, layers=3, heads=4, kv_heads=4, ffn=64, seq_len=16,
        norm_eps=1e-6, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, rope_factor=4.0, rope_original_max_positions=8, rope_mscale_all_dim=0.8,
        experts=8, top_k=3, moe_ffn=16, shared_expert=True, shared_expert_ffn=32,
        router="sigmoid", balance="bias", route_groups=4, route_top_groups=2,
        first_dense_layers=1, routed_scaling_factor=2.5, aux_loss_coef=0.0001, z_loss_coef=0.0),
    "small": ModelConfig(
        name="small", vocab=256, hidden=128, layers=8, heads=8, kv_heads=4, ffn=352, seq_len=128
    ),
    "llama2-7b": ModelConfig(
        name="llama2-7b", vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32,
        ffn=11008, seq_len=4096, rope_theta=10000.0,
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8,
        ffn=14336, seq_len=8192, rope_theta=500000.0,
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8,
        ffn=28672, seq_len=8192, rope_theta=500000.0,
    ),
    "llama3-405b": ModelConfig(
        name="llama3-405b", vocab=128256, hidden=16384, layers=126, heads=128, kv_heads=8,
        ffn=53248, seq_len=8192, rope_theta=500000.0,
    ),
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8,
        ffn=14336, seq_len=4096, rope_theta=1e6, experts=8, top_k=2,
    ),
    # Qwen3-MoE (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B; Qwen3 technical
    # report, 2025): q/k norms, head_dim 128, 128 experts top-8 renormalised, every block MoE;
    # `ffn` is the config's intermediate_size (no dense block uses it)
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4,
        head_size=128, qk_norm=True, ffn=6144, seq_len=4096, rope_theta=1e6, norm_eps=1e-6,
        experts=128, top_k=8, moe_ffn=768, norm_topk_prob=True,
    ),
    "qwen3-235b-a22b": ModelConfig(
        name="qwen3-235b-a22b", vocab=151936, hidden=4096, layers=94, heads=64, kv_heads=4,
        head_size=128, qk_norm=True, ffn=12288, seq_len=4096, rope_theta=1e6, norm_eps=1e-6,
        experts=128, top_k=8, moe_ffn=1536, norm_topk_prob=True,
    ),
    # DeepSeek-MoE 16B (config.json of deepseek-ai/deepseek-moe-16b-base; Dai et al. 2024):
    # 64 routed experts of 1408 top-6 not renormalised, 2 shared experts of 1408 = one of 2816,
    # the first block dense (first_k_dense_replace = 1, width 10944), multi-head attention
    "deepseek-moe-16b": ModelConfig(
        name="deepseek-moe-16b", vocab=102400, hidden=2048, layers=28, heads=16, kv_heads=16,
        ffn=10944, seq_len=4096, norm_eps=1e-6, experts=64, top_k=6, moe_ffn=1408,
        norm_topk_prob=False, shared_expert=True, shared_expert_ffn=2816, first_dense_layers=1,
        aux_loss_coef=0.001,
    ),
    # DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3; DeepSeek-AI, "DeepSeek-V3 Technical
    # Report", 2024): MLA (q_lora_rank 1536, kv_lora_rank 512, heads of 128 + 64 rotary, v 128),
    # YaRN (factor 40 over 4096, mscale = mscale_all_dim = 1), 256 routed experts of 2048 top-8
    # over 8 groups (best 4), sigmoid scores with the selection bias, 1 shared expert, the
    # first 3 blocks dense (18432), routed_scaling_factor 2.5, aux_loss_alpha 0.001; trained
    # at seq 4096. The MTP module (num_nextn_predict_layers 1) is not part of this preset
    "deepseek-v3-671b": ModelConfig(
        name="deepseek-v3-671b", vocab=129280, hidden=7168, layers=61, heads=128,
        kv_heads=128, ffn=18432, seq_len=4096, rope_theta=10000.0, norm_eps=1e-6,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_factor=40.0, rope_original_max_positions=4096,
        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        experts=256, top_k=8, moe_ffn=2048, shared_expert=True, shared_expert_ffn=2048,
        router="sigmoid", balance="bias", route_groups=8, route_top_groups=4,
        first_dense_layers=3, routed_scaling_factor=2.5, aux_loss_coef=0.001, z_loss_coef=0.0,
    ),
    # Kimi K2 (config.json of moonshotai/Kimi-K2-Instruct; Kimi Team, "Kimi K2: Open Agentic
    # Intelligence", 2025): DeepSeek-V3's architecture with 64 heads, 384 routed experts top-8
    # without groups (n_group 1), the first block dense, routed_scaling_factor 2.827, vocab
    # 163840, rope_theta 50000, YaRN factor 32 with beta_fast = beta_slow = 1
    "kimi-k2": ModelConfig(
        name="kimi-k2", vocab=163840, hidden=7168, layers=61, heads=64, kv_heads=64,
        ffn=18432, seq_len=4096, rope_theta=50000.0, norm_eps=1e-6,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_factor=32.0, rope_original_max_positions=4096,
        rope_beta_fast=1.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        experts=384, top_k=8, moe_ffn=2048, shared_expert=True, shared_expert_ffn=2048,
        router="sigmoid", balance="bias", first_dense_layers=1, routed_scaling_factor=2.827,
        aux_loss_coef=0.001, z_loss_coef=0.0,
    ),
}


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = spec(1, "tensor-parallel degree", ge=1)
    cp: int = spec(1, "context-parallel degree (splits the sequence)", ge=1)
    ep: int = spec(1, "expert-parallel degree (MoE models)", ge=1)
    dp: int = spec(1, "data-parallel degree", ge=1,
                   shown="the ranks the other degrees leave of the world")
    pp: int = spec(1, "pipeline-parallel degree", ge=1)
    dp_shard: int = spec(0, "hybrid sharding (HSDP): ZeRO shards over groups of this many dp "
                            "ranks (contiguous: one node when it fits) and replicates across "
                            "them; dp = dp-shard · dp-replicate", ge=0,
                         shown="dp (flat ZeRO over all of dp)")
    dp_replicate: int = spec(0, "hybrid sharding: replicas of the shard group (the gradient "
                                "shards all-reduced across them); dp = dp-shard · dp-replicate",
                             ge=0, shown="1")
    zero: int = spec(0, "ZeRO stage: 0 plain DDP, 1 shard optimizer state, 2 + gradients, "
                        "3 + parameters", choices=(0, 1, 2, 3))
    zero3_pp_gather: str = spec("step", "ZeRO-3 with pp: all-gather a stage's parameters once "
                                "per step and keep them to the step's end, or once per "
                                "micro-batch forward and backward, freed after each",
                                choices=("step", "micro"))
    schedule: str = spec("1f1b", "pipeline schedule", choices=SCHEDULES,
                         shown="1f1b, or interleaved with --virtual-stages > 1")
    virtual_stages: int = spec(1, "model chunks per pipeline rank (interleaved; zb-v and "
                                  "dualpipe-v run 2, in a V)", ge=1,
                               shown="1, or 2 with --schedule zb-v / dualpipe-v")
    micro_batches: int = spec(1, "micro-batches per optimizer step (per replica)", ge=1)
    sequence_parallel: bool = spec(False, "shard norms and residuals over tp along the sequence")
    recompute: str = spec("none", "activation recompute", choices=RECOMPUTE)
    precision: str = spec(AUTO, "compute precision (bf16/fp16 keep fp32 master weights); auto: "
                                "bf16 on GPU hardware (a cuda device for train, a GPU preset "
                                "for ledger/plan), fp32 on the CPU", choices=(AUTO, *PRECISIONS))
    grad_reduce_dtype: str = spec("fp32", "dtype gradients are reduced in", choices=GRAD_REDUCE_DTYPES)
    master_weights: str = spec("fp32", "bf16 parameters' master copy: fp32, or none (round to "
                                       "nearest), sr (stochastic rounding), kahan (bf16 "
                                       "compensation)", choices=MASTER_WEIGHTS)
    fp8: str = spec("none", "the linear layers' products in fp8 (e4m3/e5m2, a power-of-2 "
                            "scale taken at each cast): tensorwise (one scale per matrix), "
                            "rowwise (per row), blockwise (DeepSeek-V3: 1x128 tiles, 128x128 "
                            "weight blocks); embedding, head, router and norms stay in "
                            "--precision", choices=FP8_RECIPES)
    fp8_gather: bool = spec(True, "with --zero 1|2|3 --fp8 tensorwise|blockwise (and --zero 3 "
                                  "--fp8 rowwise without --pp), all-gather the fp8 linears' "
                                  "weights as e4m3 with their scales (half the bytes of bf16; "
                                  "ZeRO-1/2 keep the whole weights in e4m3 and a shard in "
                                  "--precision; --no-fp8-gather: in --precision)")
    cp_mode: str = spec("ring", "context-parallel attention: ring (K/V blocks travel the cp "
                                "ring), ulysses (all-to-all to a head cut), ring-latent "
                                "(MLA models: the latent and rotary key travel, each rank "
                                "up-projects them)", choices=CP_MODES)
    ep_dispatch: str = spec("rows", "MoE all-to-all: rows (one row per token and chosen expert) "
                                    "or tokens (one row per token and ep rank it reaches, "
                                    "combined there: DeepSeek-V3's)", choices=EP_DISPATCHES)
    order: tuple[str, ...] = spec(DIMS, "grid order, outermost first", metavar="pp,dp,ep,cp,tp")
    bucket_mb: float = spec(25.0, "gradient bucket size in MiB", gt=0)
    overlap: bool = spec(True, "reduce gradients during backward (--no-overlap: after it)")
    collectives: str = spec("backend", "data-parallel gradient reduction (and ZeRO-1/2's "
                            "parameter all-gather): the backend's collective, or fived's "
                            "send/recv ring (fived.comm.ring)", choices=COLLECTIVES)
    pp_layers: tuple[int, ...] = spec((), "layers per (virtual) stage by hand, e.g. 3,5",
                                      metavar="N,N,...", shown="balanced")
    zero_align: str = spec("none", "ZeRO shard boundaries: anywhere, or on whole rows of every "
                                   "matrix (padding; a row-local optimizer then needs no "
                                   "reduction)", choices=ZERO_ALIGN)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.cp * self.tp

    def degree(self, dim: str) -> int:
        return int(getattr(self, dim))

    @property
    def shard_degree(self) -> int:
        """N: the ranks of dp a ZeRO shard group spans (``--dp-shard``; dp when flat)."""
        if self.dp_shard:
            return self.dp_shard
        if self.dp_replicate and self.dp % self.dp_replicate == 0:
            return self.dp // self.dp_replicate
        return self.dp

    @property
    def replicate_degree(self) -> int:
        """M = dp / N: the replicas of a shard group (1: flat ZeRO, today's layout)."""
        return max(1, self.dp // max(1, self.shard_degree))

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding: ZeRO inside shard groups, replicas across (M > 1)."""
        return self.replicate_degree > 1

    def describe(self) -> str:
        parts = [f"{d}{self.degree(d)}" for d in DIMS if self.degree(d) > 1] or ["1 rank"]
        if self.hybrid:
            parts[parts.index(f"dp{self.dp}")] = (f"dp{self.dp}"
                                                  f"({self.shard_degree}s×{self.replicate_degree}r)")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.sequence_parallel:
            parts.append("sp")
        return "·".join(parts)


@dataclass(frozen=True)
class TrainConfig:
    model: str = spec("tiny", f"model preset: {', '.join(PRESETS)}")
    steps: int = spec(50, "optimizer steps", ge=1)
    global_batch: int = spec(16, "sequences per optimizer step, the same for every layout", ge=1)
    lr: float = spec(3e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = spec(0.1, "final learning rate of the cosine decay, as a fraction of "
                                    "--lr", ge=0, le=1)
    warmup: int = spec(5, "linear warm-up steps", ge=0)
    weight_decay: float = spec(0.0, "AdamW weight decay", ge=0)
    beta1: float = spec(0.9, "Adam beta1", ge=0, lt=1)
    beta2: float = spec(0.95, "Adam beta2", ge=0, lt=1)
    eps: float = spec(1e-8, "Adam epsilon", gt=0)
    grad_clip: float = spec(1.0, "clip the global gradient norm to this (0: off)", ge=0)
    seed: int = spec(1234, "seed of the initial weights and the data order")
    corpus_mb: float = spec(4.0, "MiB of the built-in corpus (this Python's stdlib source)", gt=0)
    metrics_out: str = spec("", "write one JSON line per step to this file", metavar="FILE")
    log_every: int = spec(1, "update the live line and write the metrics file every N steps "
                               "(and always the first, the last, an evaluation, a bad step)",
                          ge=1)
    data: str = spec("", "train on a prepared data directory (`fived data prepare`); the model "
                         "vocab becomes its tokenizer's, padded to a multiple of 128",
                     metavar="DIR", shown="the built-in corpus")
    doc_mask: bool = spec(False, "attend only within each document of a packed window (needs "
                                 "--data: the built-in corpus has no documents)")
    doc_positions: str = spec("continue", "RoPE positions with --doc-mask: continue (the "
                                          "window's, as torchtitan) or reset at each document",
                              choices=("continue", "reset"))
    doc_len: str = spec("", "the documents of a --dry-run with --doc-mask (fake tensors hold "
                            "no data): N, documents of N tokens packed into the windows, or a "
                            "prepared data DIR, its training documents' lengths",
                        metavar="N|DIR")
    eos_target: str = spec("count", "the loss at each EOS token, whose target is the next "
                                    "document's first token: count (torchtitan's labels) or "
                                    "ignore (Megatron's --eod-mask-loss); needs --data",
                           choices=("count", "ignore"))
    cp_balance: str = spec("zigzag", "ring context parallelism's sharding with --doc-mask: "
                                     "zigzag (two chunks per rank) or ptrr (torch's processing-"
                                     "time round robin over 8·cp blocks, by each row's "
                                     "documents)", choices=("zigzag", "ptrr"))
    eval_every: int = spec(0, "validation loss and perplexity every N steps and after the last "
                              "(0: never; needs --data)", ge=0)
    eval_batches: int = spec(4, "global batches of the validation split per evaluation", ge=1)
    prefetch: int = spec(2, "batches the --data loader reads ahead in a background thread", ge=1)
    tensorboard: str = spec("", "write TensorBoard scalars to this directory", metavar="DIR")
    memory_trace: bool = spec(False, "trace every tensor storage's life in each step and record "
                                     "each rank's peak live bytes beside the ledger's peak "
                                     "(slower: every op passes through Python; docs/ledger.md)")
    # checkpoints (fived.checkpoint, docs/checkpoints.md)
    save_dir: str = spec("", "save checkpoints under this directory (DIR/step-N)", metavar="DIR")
    save_every: int = spec(0, "save every N steps and after the last (0: only after the last, "
                              "when --save-dir is given)", ge=0)
    keep: int = spec(0, "keep only the newest K checkpoints (0: all)", ge=0, metavar="K")
    async_save: bool = spec(False, "write checkpoints in the background while training goes on")
    stop_after: int = spec(0, "stop after this many steps of --steps (0: all); the schedule "
                              "stays --steps long, so --resume continues it exactly", ge=0)
    resume: str = spec("", "resume from DIR (its newest checkpoint) or DIR/step-N, any layout; "
                           "'auto': the newest complete checkpoint under --save-dir if there is "
                           "one, else a fresh start (the same command line starts and restarts "
                           "a run: torchrun --max-restarts, SLURM requeue)",
                       metavar="DIR|auto")
    preempt_signals: str = spec("TERM,USR1", "signals that make every rank save at the next step "
                                "boundary and exit with status 75 (preempted, resumable); "
                                "comma-separated names, '' for none", metavar="SIG,SIG")
    max_bad_steps: int = spec(3, "a step whose loss or gradient norm is NaN/inf is skipped; stop "
                                 "after K such steps in a row (the last checkpoint is kept)",
                              ge=1, metavar="K")
    init_from: str = spec("", "start from a Hugging Face Llama/Mixtral directory (safetensors + "
                              "config.json); the model shape comes from its config.json",
                          metavar="HF_DIR")
    optimizer: str = spec("adamw", "adamw (elementwise), adafactor (factored second moment), "
                                   "muon (orthogonalised hidden matrices, AdamW elsewhere), "
                                   "rownorm (row-normalised momentum)", choices=OPTIMIZERS)
    compile: bool = spec(False, "torch.compile each transformer block (meant for the GPU path; "
                                "not yet run on GPU hardware)")


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError([f"--model {name}: no such preset{did_you_mean(name, list(PRESETS))} "
                           f"(choose one of {', '.join(PRESETS)})"])
    return PRESETS[name]


def auto_precision(gpu: bool) -> str:
    """What ``--precision auto`` means: bf16 on GPU hardware, fp32 on the CPU."""
    return "bf16" if gpu else "fp32"


def resolve_precision(par: ParallelConfig, gpu: bool, where: str) -> tuple[ParallelConfig, str]:
    """The one rule for ``--precision auto``: (the layout with a concrete precision, the words
    every command prints first). ``gpu``: the run is on GPU hardware (a cuda device for
    ``train``, a GPU preset for ``ledger``/``plan``; ``--gpu this-machine`` and the CPU are not);
    ``where``: the device or preset, for the words. An explicit precision is kept as given."""
    if par.precision != AUTO:
        return par, f"precision {par.precision}"
    p = auto_precision(gpu)
    return replace(par, precision=p), f"precision {p} (auto: {where})"


def precision_of(par: ParallelConfig) -> str:
    """The layout's precision where no command resolved ``auto`` (the torch-free ledger's
    Python API, which knows no device): the CPU's, fp32, as ``fived train`` runs here."""
    return auto_precision(False) if par.precision == AUTO else par.precision


# ---------------------------------------------------------------- near names
def suggest(word: str, choices: list[str], n: int = 3) -> list[str]:
    """The choices closest to ``word`` (difflib's ratio, at least 0.6; prefixes first)."""
    choices = [str(c) for c in choices]
    prefix = [c for c in choices if len(word.strip("-")) > 2 and c.startswith(word)]
    close = difflib.get_close_matches(word, choices, n=n, cutoff=0.6)
    if close:  # the best, and the others only when nearly as close
        best = difflib.SequenceMatcher(None, word, close[0]).ratio()
        close = [c for c in close if difflib.SequenceMatcher(None, word, c).ratio() >= best - 0.05]
    return list(dict.fromkeys(prefix + close))[:n]


def did_you_mean(word: str, choices: list[Any]) -> str:
    """"; did you mean X?" (or "X or Y"), "" when nothing is close. Integer choices: the
    nearest value (``--zero 4`` -> 3)."""
    if choices and all(isinstance(c, int) and not isinstance(c, bool) for c in choices):
        try:
            v = int(word)
        except (TypeError, ValueError):
            return ""
        near = min(choices, key=lambda c: (abs(c - v), c))
        return f"; did you mean {near}?"
    near = suggest(str(word), [str(c) for c in choices])
    return f"; did you mean {' or '.join(near)}?" if near else ""


# ---------------------------------------------------------------- the flag names
_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}


@functools.cache
def flag_of(section: str, name: str) -> str:
    """The command-line name of a field ("" for a TOML-only one): ``--global-batch``."""
    f = {f.name: f for f in fields(_SECTIONS[section])}[name]
    flag = f.metadata.get("flag")
    if flag is None:
        flag = "--" + name.replace("_", "-")
    return flag


def _label(section: str, name: str) -> str:
    return flag_of(section, name) or f"[{section}] {name}"


def _bound_problem(section: str, f: dataclasses.Field, v: Any) -> str | None:
    """What is wrong with value ``v`` of field ``f`` (None: nothing)."""
    m = f.metadata
    what = _label(section, f.name)
    kind = type(f.default)
    if kind is bool and not isinstance(v, bool):
        return f"{what} must be true or false (got {v!r})"
    if kind is str and not isinstance(v, str):
        return f"{what} must be a string (got {v!r})"
    if kind is tuple and not isinstance(v, tuple):
        return f"{what} must be a list (got {v!r})"
    if m.get("choices") is not None and v not in m["choices"]:
        return f"{what} {v!r}: choose one of {', '.join(map(str, m['choices']))}"
    ge, gt, lt, le = m.get("ge"), m.get("gt"), m.get("lt"), m.get("le")
    if ge is None and gt is None and lt is None and le is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"{what} must be a number (got {v!r})"
    if kind is int and not isinstance(v, int):
        return f"{what} must be an integer (got {v!r})"
    low = (ge is None or v >= ge) and (gt is None or v > gt)
    high = (lt is None or v < lt) and (le is None or v <= le)
    if low and high:
        return None

    def g(x: float) -> str:
        return f"{x:g}"

    if (lt is not None or le is not None) and (ge is not None or gt is not None):
        lo = f"[{g(ge)}" if ge is not None else f"({g(gt)}"
        hi = f"{g(lt)})" if lt is not None else f"{g(le)}]"
        return f"{what} must be in {lo}, {hi} (got {v:g})"
    if ge is not None:
        return f"{what} must be >= {g(ge)} (got {v:g})"
    if gt is not None:
        return f"{what} must be > {g(gt)} (got {v:g})"
    return f"{what} must be {'<' if lt is not None else '<='} {g(lt if lt is not None else le)} " \
           f"(got {v:g})"


def check_field(section: str, name: str, value: Any) -> str | None:
    """The problem with one value of one field, as ``validate`` words it (None: fine)."""
    f = {f.name: f for f in fields(_SECTIONS[section])}[name]
    return _bound_problem(section, f, value)


def _field_problems(section: str, obj: Any) -> list[str]:
    out = []
    for f in fields(obj):
        if section == "train" and f.name == "model":
            continue  # the preset name: checked by ``preset``
        p = _bound_problem(section, f, getattr(obj, f.name))
        if p:
            out.append(p)
    return out


@functools.lru_cache(maxsize=64)
def _model_problems_cached(model: ModelConfig) -> tuple[str, ...]:
    return tuple(_field_problems("model", model))


def _model_problems(model: ModelConfig) -> list[str]:
    try:
        return list(_model_problems_cached(model))
    except TypeError:  # unhashable field values (a list from a TOML): check it as it is
        return _field_problems("model", model)


def check_values(model: ModelConfig | None = None, par: ParallelConfig | None = None,
                 train: TrainConfig | None = None) -> list[str]:
    """Every field against its own bounds and choices (``spec``), one line per problem."""
    out: list[str] = []
    for section, obj in (("model", model), ("parallel", par), ("train", train)):
        if obj is None:
            continue
        # a model is checked once (the planner validates thousands of layouts of one model)
        out += _model_problems(obj) if section == "model" else _field_problems(section, obj)
    if par is not None:
        if sorted(par.order) != sorted(DIMS):
            out.append(f"--order {','.join(par.order)}: give a permutation of {','.join(DIMS)}")
        if any(not isinstance(x, int) or x < 1 for x in par.pp_layers):
            out.append(f"--pp-layers {list(par.pp_layers)}: every stage needs >= 1 layer")
    return out


def check_count(flag: str, n: Any, least: int = 1) -> None:
    """A count given by a command's own flag (``--gpus``, ``--nprocs``): at least ``least``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise ConfigError([f"{flag} must be an integer >= {least} (got {n!r})"])


# ---------------------------------------------------------------- validation
def _divides(problems: list[str], a: int, b: int, what: str, fix: str) -> None:
    if a <= 0 or b % a != 0:
        problems.append(f"{what}: {b} is not divisible by {a}; {fix}")


def validate(
    model: ModelConfig,
    par: ParallelConfig,
    train: TrainConfig | None = None,
    world_size: int | None = None,
) -> None:
    """Raise ``ConfigError`` naming every broken constraint of this (model, layout, run).

    First each value against its own bounds (a degree of 0, a negative learning rate ...); if
    any is out of bounds those are the error. Then everything the values must satisfy together:
    the world size, the shapes each degree must divide, the pipeline split, what a schedule
    needs, the batch split, and what is not built (ZeRO-3 under a pipeline)."""
    p = check_values(model, par, train)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        p.append(f"world size must be >= 1 (got {world_size!r})")
    if p:
        raise ConfigError(p)
    for check in (_check_world, _check_shapes, _check_tp, _check_pipeline, _check_cp,
                  _check_experts, _check_routing, _check_mtp):
        check(p, model, par, world_size)
    if train is not None:
        _check_batch(p, par, train)
        _check_recovery(p, train)
        _check_documents(p, model, par, train)
    _check_zero_align(p, par)
    _check_fp8(p, model, par, train)
    p += hybrid_problems(par)
    if p:
        raise ConfigError(p)


def check_runtime_model(model: ModelConfig) -> None:
    """What ``fived train`` can build: the Llama-style decoder (``fived.model``). The GPT-style
    shape fields are for the ledger; a run that asks for them gets one ConfigError."""
    p = [f"{flag_of('model', k)} {getattr(model, k)}: the runtime model is Llama-style "
         f"({want}); the ledger and planner describe this shape, `fived train` does not build it"
         for k, want in (("mlp", "swiglu"), ("positions", "rope"), ("norm", "rmsnorm"),
                         ("bias", False)) if getattr(model, k) != want]
    if p:
        raise ConfigError(p)


def _check_world(p: list[str], model: ModelConfig, par: ParallelConfig, world: int | None
                 ) -> None:
    if world is not None and world != par.world_size:
        rest = par.world_size // par.dp
        named = " ".join(f"--{d} {par.degree(d)}" for d in DIMS if d != "dp" and par.degree(d) > 1)
        if world % rest == 0:
            hint = f"use --dp {world // rest}"
        else:
            tps = [t for t in range(1, world + 1) if world % t == 0 and not _tp_problems(model, t)]
            hint = (f"{named} does not divide {world} ranks; choose degrees whose product is "
                    f"{world} (--tp {', '.join(map(str, tps))} fit {model.name} and {world} ranks)")
        p.append(f"world size {world} != pp·dp·ep·cp·tp = {par.pp}·{par.dp}·{par.ep}·{par.cp}·"
                 f"{par.tp} = {par.world_size}; {hint}")


MLA_FIELDS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _check_mla(p: list[str], model: ModelConfig) -> None:
    """Multi-head latent attention's fields (``fived.model.mla``) and what it excludes."""
    asked = [f for f in MLA_FIELDS if getattr(model, f)]
    if not model.is_mla:
        if asked:
            p.append(f"kv_lora_rank {model.kv_lora_rank}: {', '.join(asked)} "
                     f"{'are' if len(asked) > 1 else 'is'} multi-head latent attention's; give "
                     "kv_lora_rank > 0 (the key/value latent width, DeepSeek-V3: 512)")
        if model.yarn:
            p.append(f"rope_factor {model.rope_factor:g}: YaRN scaling is built for MLA models "
                     "only (kv_lora_rank > 0); use rope_factor = 1")
        return
    if model.qk_rope_head_dim <= 0 or model.qk_rope_head_dim % 2:
        p.append(f"qk_rope_head_dim {model.qk_rope_head_dim} must be even and > 0 for RoPE (it "
                 "rotates pairs; DeepSeek-V3: 64)")
    if model.v_head_dim <= 0:
        p.append(f"v_head_dim {model.v_head_dim} must be > 0 with MLA (DeepSeek-V3: 128)")
    elif model.v_head_dim > model.qk_nope_head_dim + model.qk_rope_head_dim:
        p.append(f"v_head_dim {model.v_head_dim} > qk_nope_head_dim + qk_rope_head_dim = "
                 f"{model.qk_nope_head_dim + model.qk_rope_head_dim}: the flash core pads v to "
                 "the query's width, never cuts it")
    for f in ("qk_norm", "qkv_bias", "head_size"):
        if getattr(model, f):
            p.append(f"{f} = {getattr(model, f)!r} with MLA (kv_lora_rank > 0): MLA has its own "
                     "head widths and no q/k norms or biases; drop it")


def _check_shapes(p: list[str], model: ModelConfig, par: ParallelConfig, world: int | None
                  ) -> None:
    _check_mla(p, model)
    if model.hidden % model.heads and not model.head_size and not model.is_mla:
        p.append(f"hidden {model.hidden} is not divisible by heads {model.heads}; give "
                 "head_size (the width of one head) or a hidden that heads divides")
    if model.heads % model.kv_heads and not model.is_mla:
        p.append(f"heads {model.heads} is not divisible by kv_heads {model.kv_heads}")
    if model.head_dim % 2 and model.positions == "rope" and not model.is_mla:
        what = (f"head_size {model.head_size}" if model.head_size else
                f"head_dim {model.head_dim} (hidden/heads)")
        p.append(f"{what} must be even for RoPE (it rotates pairs); give an even head_size")
    if model.qkv_bias and model.bias:
        p.append("qkv_bias with bias = true: bias already puts one on every linear layer (q, "
                 "k, v included); give one of them")
    if model.is_moe and model.mlp != "swiglu":
        p.append(f"--mlp {model.mlp} with experts: MoE experts are SwiGLU; use --mlp swiglu")


def _tp_problems(model: ModelConfig, tp: int) -> list[str]:
    """What ``tp`` does not divide in ``model`` ("attention heads 4" ...); [] when it fits."""
    out = []
    if tp <= 1:
        return out
    if model.heads % tp:
        out.append(f"attention heads {model.heads}")
    if model.is_mla:  # no kv heads: the latent is whole on every rank
        pass
    elif tp > model.kv_heads and tp % model.kv_heads:
        out.append(f"kv_heads {model.kv_heads} (a tp above kv_heads must be a multiple of kv_heads)")
    elif tp <= model.kv_heads and model.kv_heads % tp:
        out.append(f"kv_heads {model.kv_heads}")
    if model.ffn % tp:
        out.append(f"ffn {model.ffn}")
    if model.vocab % tp:
        out.append(f"vocab {model.vocab}")
    if model.is_moe and model.shared_expert and model.shared_ffn % tp:
        out.append(f"shared expert ffn {model.shared_ffn}")
    return out


def tp_choices(model: ModelConfig, world: int | None = None, upto: int = 64) -> list[int]:
    """The tensor-parallel degrees ``model`` takes (dividing ``world`` when it is given)."""
    top = world if world else upto
    return [t for t in range(1, top + 1) if (not world or world % t == 0)
            and not _tp_problems(model, t)]


def _check_tp(p: list[str], model: ModelConfig, par: ParallelConfig, world: int | None) -> None:
    tp = par.tp
    bad = _tp_problems(model, tp)
    if bad:
        ok = tp_choices(model, None, max(world or 1, 8))
        what = ", ".join(bad[:-1]) + (" and " if len(bad) > 1 else "") + bad[-1]
        p.append(f"--tp {tp}{f' ({world} rank(s))' if world else ''}: {model.name}'s {what} "
                 f"{'are' if len(bad) > 1 else 'is'} not divisible by {tp}; --tp can be "
                 f"{', '.join(map(str, ok[:-1]))}{' or ' if len(ok) > 1 else ''}{ok[-1]} "
                 f"for {model.name}")
    if par.sequence_parallel and tp == 1:
        p.append("--sequence-parallel needs --tp > 1")
    if par.sequence_parallel:
        _divides(p, tp * par.cp, model.seq_len, "seq_len over cp·tp (sequence parallelism)",
                 "use a seq_len that cp·tp divides")


def _check_pipeline(p: list[str], model: ModelConfig, par: ParallelConfig, world: int | None
                    ) -> None:
    stages = par.pp * par.virtual_stages
    if par.pp_layers:
        if len(par.pp_layers) != stages or sum(par.pp_layers) != model.layers:
            p.append(f"--pp-layers {list(par.pp_layers)} must have pp·v = {stages} entries "
                     f"summing to {model.layers} layers")
    elif stages > model.layers:  # fewer layers than stages: the balanced split cannot cut it
        p.append(f"pp·virtual_stages = {stages} stages for {model.layers} layers: each stage "
                 "needs a layer; use a smaller --pp or --virtual-stages")
    # otherwise the balanced split (fived.ledger.params.balanced_split) cuts any count, e.g.
    # Llama 3 405B's 126 layers over pp16 as 7, 8 × 14, 7 -- the runtime, ledger and planner alike
    if par.schedule in V_SCHEDULES:
        if par.virtual_stages != 2:
            p.append(f"--schedule {par.schedule} runs exactly 2 stages per rank (a V); give "
                     "--virtual-stages 2 (the default with this schedule)")
        if par.schedule == "dualpipe-v" and par.pp > 1 and par.micro_batches < 2 * par.pp:
            p.append(f"--schedule dualpipe-v needs --micro-batches >= 2·pp = {2 * par.pp} "
                     f"(got {par.micro_batches})")
    elif par.virtual_stages > 1 and par.schedule != "interleaved":
        p.append("--virtual-stages > 1 needs --schedule interleaved")
    elif par.virtual_stages > 1 and par.pp == 1:
        p.append(f"--virtual-stages {par.virtual_stages} with --pp 1: model chunks per pipeline "
                 "rank need a pipeline; add --pp 2 or more (or drop --virtual-stages)")
    if par.schedule == "interleaved" and par.pp > 1:
        if par.virtual_stages < 2:
            p.append("--schedule interleaved needs --virtual-stages >= 2")
        _divides(p, par.pp, par.micro_batches, "--micro-batches over --pp (interleaved)",
                 "give a multiple of --pp")
    # tied embeddings and multi-token prediction with pp > 1: the first and the last stage
    # both hold the embedding, its gradient summed over the embedding group (grid "embed")


def _check_mtp(p: list[str], model: ModelConfig, par: ParallelConfig, world: int | None
               ) -> None:
    """Module k of multi-token prediction predicts the token k+1 ahead: a sequence needs more
    than mtp_depth tokens for the last module to have a target; under cp each rank fetches
    the next mtp_depth targets after each of its zigzag chunks from the chunk's successor, so a
    chunk (seq_len / 2·cp tokens) must hold them."""
    d = model.mtp_depth
    if d <= 0:
        return
    if model.seq_len <= d:
        p.append(f"mtp_depth {d} with --seq-len {model.seq_len}: module {d} predicts the token "
                 f"{d + 1} ahead, so a sequence needs more than {d} tokens for it to have a "
                 f"target; use --seq-len {d + 1} or more, or a smaller mtp_depth")
    elif par.cp > 1 and model.seq_len // (2 * par.cp) < d:
        p.append(f"mtp_depth {d} with --cp {par.cp}: each zigzag chunk of seq_len / 2·cp = "
                 f"{model.seq_len // (2 * par.cp)} tokens must hold the {d} shifted targets its "
                 f"rank fetches; use --seq-len {2 * par.cp * d} or more, or a smaller --cp")


def _check_documents(p: list[str], model: ModelConfig, par: ParallelConfig,
                     train: TrainConfig) -> None:
    if model.mtp_depth and train.cp_balance == "ptrr" and par.cp > 1:
        p.append(f"mtp_depth {model.mtp_depth} with --cp-balance ptrr: multi-token prediction "
                 "fetches its shifted targets from the zigzag chunks; use --cp-balance zigzag")
    if train.cp_balance == "ptrr" and par.cp > 1:
        if par.cp_mode not in ("ring", "ring-latent"):
            p.append(f"--cp-balance ptrr is ring attention's sharding; --cp-mode {par.cp_mode} "
                     "is balanced without it")
        _divides(p, 8 * par.cp, model.seq_len, "seq_len over 8·cp (--cp-balance ptrr)",
                 "pick seq_len")


def _check_cp(p: list[str], model: ModelConfig, par: ParallelConfig, world: int | None) -> None:
    if par.cp > 1:
        if model.seq_len % (2 * par.cp):
            step = 2 * par.cp
            lo, hi = model.seq_len // step * step, (model.seq_len // step + 1) * step
            near = " or ".join(str(x) for x in (lo, hi) if x > 0)
            p.append(f"--seq-len {model.seq_len} with --cp {par.cp}: context parallelism's "
                     f"zigzag split cuts each sequence into 2·cp = {step} equal chunks, so "
                     f"seq_len must be divisible by {step}; use --seq-len {near}")
        if par.cp_mode == "ring-latent" and not model.is_mla:
            p.append(f"--cp-mode ring-latent rotates MLA's latent; model {model.name} has no "
                     "latent (kv_lora_rank 0): use --cp-mode ring")
        elif par.cp_mode == "ring-latent" and getattr(par, "fp8", "none") != "none":
            p.append(f"--cp-mode ring-latent with --fp8 {par.fp8}: the latent ring's "
                     "up-projection runs in --precision (not built in fp8); use --cp-mode ring")
        if par.cp_mode == "ulysses":
            _divides(p, par.cp, model.heads // max(par.tp, 1),
                     "heads per tp rank over cp (ulysses)",
                     "use --cp-mode ring or a cp dividing heads/tp")


def _check_experts(p: list[str], model: ModelConfig, par: ParallelConfig, world: int | None
                   ) -> None:
    if par.ep > 1 and not model.is_moe:
        p.append(f"--ep {par.ep} needs a MoE model (experts > 0); try --model tiny-moe")
    if model.is_moe:
        if par.ep <= 0 or model.experts % par.ep:  # the divisors listed only when it fails
            ok = ", ".join(str(d) for d in range(1, model.experts + 1) if model.experts % d == 0)
            _divides(p, par.ep, model.experts, f"experts over --ep {par.ep}",
                     f"pick --ep from the divisors of {model.experts} experts: {ok}")
        if not 1 <= model.top_k <= model.experts:
            p.append(f"top_k {model.top_k} must be in [1, experts={model.experts}]")
        if model.first_dense_layers >= model.layers:
            p.append(f"first_dense_layers {model.first_dense_layers} must be < layers "
                     f"{model.layers} (a MoE model needs at least one MoE block; use "
                     "experts = 0 for a dense model)")


def _check_routing(p: list[str], model: ModelConfig, par: ParallelConfig, world: int | None
                   ) -> None:
    """The shared expert and node-limited routing: their fields and how they combine."""
    if model.shared_expert_gate and not model.shared_expert:
        p.append("shared_expert_gate = true needs a shared expert (shared_expert = true): "
                 "there is nothing to gate")
    if model.shared_expert_ffn and not model.shared_expert:
        p.append(f"shared_expert_ffn {model.shared_expert_ffn} needs shared_expert = true")
    G, M = model.route_groups, model.route_top_groups
    if not (G or M):
        return
    if not model.is_moe:
        p.append("route_groups / route_top_groups need a MoE model (experts > 0)")
    elif G < 2 or model.experts % G:
        p.append(f"route_groups {G} must be ≥ 2 and divide experts {model.experts}")
    elif not 1 <= M <= G:
        p.append(f"route_top_groups {M} must be in [1, route_groups={G}]")
    elif M * (model.experts // G) < model.top_k:
        p.append(f"route_top_groups {M} × {model.experts // G} experts per group < top_k "
                 f"{model.top_k}: a token could not find its experts")


def _check_batch(p: list[str], par: ParallelConfig, train: TrainConfig) -> None:
    replicas = par.dp * par.ep
    if train.global_batch % replicas:
        p.append(f"--global-batch: global batch {train.global_batch} is not divisible by dp·ep = "
                 f"{replicas}; use --global-batch "
                 f"{replicas * max(1, train.global_batch // replicas)}")
    elif (train.global_batch // replicas) % par.micro_batches:
        p.append(f"sequences per replica {train.global_batch // replicas} are not divisible by "
                 f"--micro-batches {par.micro_batches}")


RESUME_AUTO = "auto"
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: preempted, saved, resumable (docs/checkpoints.md)


def preempt_signal_names(spec_: str) -> tuple[list[str], list[str]]:
    """``--preempt-signals TERM,USR1`` -> (the names, the unknown ones)."""
    import signal as _signal

    names = [n.strip().upper().removeprefix("SIG") for n in spec_.split(",") if n.strip()]
    bad = [n for n in names if n in ("KILL", "STOP") or not hasattr(_signal, f"SIG{n}")]
    return names, bad


def _check_recovery(p: list[str], train: TrainConfig) -> None:
    if train.resume == RESUME_AUTO and not train.save_dir:
        p.append("--resume auto: resumes the newest checkpoint under --save-dir, but no "
                 "--save-dir is given; add --save-dir DIR")
    _, bad = preempt_signal_names(train.preempt_signals)
    if bad:
        p.append(f"--preempt-signals {train.preempt_signals}: {', '.join(bad)} is not a signal "
                 "this process can catch (use names such as TERM, USR1, USR2, INT; '' for none)")


def fp8_cut_widths(model: ModelConfig, tp: int) -> dict[str, int]:
    """The widths a tp rank holds of each dimension tp cuts in the fp8 linears."""
    kv = model.kv_heads * model.head_dim // min(tp, model.kv_heads)
    out = {"q heads": model.attn_dim // tp, "kv heads": kv, "ffn": model.ffn // tp}
    if model.experts and model.shared_ffn:
        out["shared ffn"] = model.shared_ffn // tp
    return out


def fp8_gather_applies(par: ParallelConfig) -> bool:
    """Whether ZeRO can all-gather the fp8 linears' weights in e4m3 (what ``--no-fp8-gather``
    turns off; ``fived.ledger.params.fp8_gather`` says whether it does):

    * ZeRO-3, ``--fp8 tensorwise|blockwise``, or rowwise without pp (its forward and backward
      need two casts of W: the pipeline's chunks, gathered for both, would carry both, as many
      bytes as bf16);
    * ZeRO-1/2, ``--fp8 tensorwise|blockwise`` (Megatron-Core's ``--fp8-param-gather``: the
      rank keeps its compute-dtype shard and the whole weight's fp8 cast, gathered after each
      step). Not rowwise: the whole weight would be kept in both of its casts (per row for the
      forward, per column for the dgrad), 2 bytes per element, bf16's, so rowwise keeps the
      compute-dtype gather (as it does under ZeRO-3 with pp)."""
    if par.zero == 3:
        return par.fp8 in ("tensorwise", "blockwise") or (par.fp8 == "rowwise"
                                                          and par.pp == 1)
    return par.zero in (1, 2) and par.fp8 in ("tensorwise", "blockwise")


def _check_fp8(p: list[str], model: ModelConfig, par: ParallelConfig,
               train: TrainConfig | None = None) -> None:
    if not par.fp8_gather and not fp8_gather_applies(par):
        pp = f" --pp {par.pp}" if par.pp > 1 and par.fp8 == "rowwise" else ""
        p.append(f"--no-fp8-gather: turns off ZeRO's fp8 all-gather (--zero 1, 2 or 3 with "
                 f"--fp8 tensorwise or blockwise; --zero 3 --fp8 rowwise without --pp), but "
                 f"--zero {par.zero} --fp8 {par.fp8}{pp} gathers nothing in fp8; drop it")
    if par.fp8 == "none":
        return
    if par.precision == "fp16":
        p.append(f"--fp8 {par.fp8}: fp8 products with fp16 around them would need the loss "
                 "scale inside every cast; use --precision bf16 (fp8 training) or fp32 (fp8 "
                 "products, everything else fp32)")
    if model.is_moe and model.expert_matmul == "grouped":
        p.append(f"expert_matmul = grouped with --fp8 {par.fp8}: the experts' fp8 products run "
                 "as a loop of fp8 linears (one scaled matmul per expert; the fused fp8 grouped "
                 "GEMM is not built); set expert_matmul = auto or loop")
    if par.fp8 == "blockwise" and par.tp > 1:
        odd = {k: w for k, w in fp8_cut_widths(model, par.tp).items() if w % 128}
        if odd:
            what = ", ".join(f"{k} {w}" for k, w in odd.items())
            p.append(f"--fp8 blockwise with --tp {par.tp}: a 128-wide tile would straddle the "
                     f"tp cut ({what} per rank, not multiples of 128); use tensorwise or "
                     "rowwise, or a tp whose shards are whole tiles")
    if par.fp8 == "blockwise" and par.cp > 1:  # the wgrad's token tiles within a cp chunk
        ptrr = train is not None and train.cp_balance == "ptrr"
        chunk = model.seq_len // ((8 if ptrr else 2) * par.cp)
        if chunk % 128:
            p.append(f"--fp8 blockwise with --cp {par.cp}: a 128-token tile of the weight "
                     f"gradient would straddle the cp cut ({chunk}-token chunks of seq_len "
                     f"{model.seq_len}, not multiples of 128); use tensorwise or rowwise, or a "
                     "seq_len whose chunks are whole tiles")


def _check_zero_align(p: list[str], par: ParallelConfig) -> None:
    if par.master_weights != "fp32" and par.precision != "bf16":
        p.append(f"--master-weights {par.master_weights}: drops the fp32 master of bf16 "
                 f"parameters, but --precision is {par.precision}; use --precision bf16")
    if par.zero_align == "rows" and par.zero == 0:
        p.append("--zero-align rows: aligns ZeRO shards, but --zero 0 keeps none; use --zero 1, "
                 "2 or 3, or drop --zero-align")


def hybrid_problems(par: ParallelConfig, need_zero: bool = True) -> list[str]:
    """What ``--dp-shard`` / ``--dp-replicate`` must satisfy (hybrid sharding, docs/data-parallel.md):
    N·M = dp, N divides dp, a ZeRO stage to shard with, and tp inside dp in the grid order (a
    shard group is whole tp groups of contiguous ranks, never a strided cut through them)."""
    if not (par.dp_shard or par.dp_replicate):
        return []
    p: list[str] = []
    divs = ", ".join(str(d) for d in range(1, par.dp + 1) if par.dp % d == 0)
    n, m = par.dp_shard, par.dp_replicate
    if n and par.dp % n:
        p.append(f"--dp-shard {n}: must divide dp = {par.dp} (the world / pp·ep·cp·tp); valid "
                 f"values: {divs}")
    elif m and par.dp % m:
        p.append(f"--dp-replicate {m}: must divide dp = {par.dp}; valid values: {divs}")
    elif n and m and n * m != par.dp:
        p.append(f"--dp-shard {n} × --dp-replicate {m} = {n * m} != dp = {par.dp}; valid "
                 f"--dp-shard values for dp {par.dp} with --dp-replicate {m}: {par.dp // m}")
    if need_zero and par.zero == 0:
        p.append("--dp-shard / --dp-replicate with --zero 0: plain DDP shards nothing; valid "
                 "--zero values with hybrid sharding: 1, 2, 3 (or drop --dp-shard)")
    if par.hybrid and "tp" in par.order and "dp" in par.order and \
            par.order.index("tp") < par.order.index("dp"):
        p.append(f"--dp-shard {par.shard_degree} with --order {','.join(par.order)}: tp sits "
                 f"outside dp, so a shard group would split tp groups across its strided ranks; "
                 f"valid orders put tp after dp (e.g. pp,dp,ep,cp,tp)")
    return p


def check_outputs(train: TrainConfig) -> None:
    """The files the run writes can be written (before any rank starts; nothing is created)."""
    if not train.metrics_out:
        return
    path = Path(train.metrics_out)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        problem = "is a directory"
    elif not parent.is_dir():
        problem = f"directory {str(parent)!r} does not exist"
    elif not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problem = "is not writable"
    else:
        return
    raise ConfigError([f"--metrics-out {train.metrics_out}: {problem}"])


# ---------------------------------------------------------------- the world
def fill_dp(par: ParallelConfig, dp_given: bool, world: int | None = None
            ) -> tuple[ParallelConfig, int | None]:
    """Data parallelism takes the ranks the other degrees leave; returns (layout, world).

    ``dp_given`` (a --dp flag, or ``dp`` in the TOML's [parallel]): the layout is kept and the
    world is its product unless ``world`` says otherwise (``validate`` then names the mismatch).
    Otherwise dp = world // (tp·cp·ep·pp), where the world is ``world`` (--nprocs, --gpus,
    torchrun's WORLD_SIZE) or, with none, ``DEFAULT_WORLD`` ranks rounded up to a multiple of
    the other degrees (``fived train`` with nothing runs dp = 4). A degree below 1 is left for
    ``validate`` to name (the world is then ``world`` as given, possibly None)."""
    others = par.tp * par.cp * par.ep * par.pp
    if others < 1:  # an invalid degree: leave it for validate to name
        return par, world
    if not dp_given and par.dp_shard and par.dp_replicate:  # dp = N·M
        par = replace(par, dp=par.dp_shard * par.dp_replicate)
        return par, (world if world is not None else par.world_size)
    if world is None:
        world = par.world_size if dp_given else others * max(1, DEFAULT_WORLD // others)
    if not dp_given:
        par = replace(par, dp=max(1, world // others))
    return par, world


# ---------------------------------------------------------------- TOML in and out
def _coerce(cls: type, values: dict[str, Any], section: str) -> dict[str, Any]:
    known = {f.name: f for f in fields(cls)}
    out: dict[str, Any] = {}
    bad = [k for k in values if k not in known]
    if bad:
        raise ConfigError([f"[{section}] unknown key(s) {bad}; known: {sorted(known)}"])
    for k, v in values.items():
        out[k] = tuple(v) if isinstance(v, list) else v
    return out


def read_toml(path: str | Path) -> tuple[ModelConfig, ParallelConfig, TrainConfig, set[str]]:
    """``load_toml`` plus the keys the file gave, as ``"section.key"`` (``"parallel.dp"``)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError([f"--config {path}: cannot read it ({e})"]) from None
    extra = sorted(set(data) - set(_SECTIONS) - {"data"})
    if extra:
        raise ConfigError([f"unknown table(s) {extra} in {path}; use [model], [parallel], "
                           "[train], [data]"])
    for s in _SECTIONS:
        if not isinstance(data.get(s, {}), dict):
            raise ConfigError([f"[{s}] in {path} must be a table"])
    tvals = data.get("train", {})
    if "data" in data:  # a mixture's table: the --data spec it stands for
        if "data" in tvals:
            raise ConfigError([f"{path}: [train] data and a [data] table both give the data; "
                               "keep one"])
        tvals = {**tvals, "data": mixture_spec(data["data"], path)}
    mvals = dict(data.get("model", {}))
    name = mvals.get("name", tvals.get("model", TrainConfig.model))
    if "name" in mvals and "model" in tvals and mvals["name"] != tvals["model"]:
        raise ConfigError([f"{path}: [model] name {mvals['name']!r} and [train] model "
                           f"{tvals['model']!r} disagree; give one"])
    try:
        train = TrainConfig(**_coerce(TrainConfig, tvals, "train"))
        model = replace(preset(name), **_coerce(ModelConfig, mvals, "model"))
        par = ParallelConfig(**_coerce(ParallelConfig, data.get("parallel", {}), "parallel"))
    except TypeError as e:  # pragma: no cover - _coerce already names unknown keys
        raise ConfigError([f"{path}: {e}"]) from None
    given = {f"{s}.{k}" for s in _SECTIONS for k in data.get(s, {})}
    if "data" in data:
        given.add("train.data")
    if "train.model" in given or "model.name" in given:
        given |= {"train.model", "model.name"}
    return model, par, replace(train, model=model.name), given


def mixture_spec(table: Any, path: str | Path = "") -> str:
    """A TOML ``[data]`` table -> the ``--data`` mixture spec it stands for::

        [data]
        code = { dir = "data/code", weight = 0.3 }
        web = { dir = "data/web", weight = 0.7 }

    is ``--data code=data/code:0.3,web=data/web:0.7``. A ConfigError naming ``[data]`` and
    the source when an entry is not a table of ``dir`` (a string) and ``weight`` (a number
    >= 0), or when the weights sum to zero."""
    where = f" in {path}" if path else ""
    if not isinstance(table, dict) or not table:
        raise ConfigError([f"[data]{where} must be a table of sources: NAME = {{ dir = "
                           '"DIR", weight = W }'])
    parts, problems, total = [], [], 0.0
    for name, src in table.items():
        if not isinstance(src, dict) or set(src) != {"dir", "weight"}:
            problems.append(f"[data] {name}{where}: give {{ dir = \"DIR\", weight = W }} "
                            f"(it has {sorted(src) if isinstance(src, dict) else src!r})")
            continue
        d, w = src["dir"], src["weight"]
        if not isinstance(w, (int, float)) or isinstance(w, bool):
            problems.append(f"[data] {name}.weight = {w!r}{where}: not a number")
        elif not 0 <= w < float("inf"):
            problems.append(f"[data] {name}.weight = {w!r}{where}: must be a finite number "
                            ">= 0")
        else:
            total += w
        if not isinstance(d, str) or not d or "," in d:
            problems.append(f"[data] {name}.dir = {d!r}{where}: a directory path without ','")
        if any(c in name for c in "=,:") or not name.strip():
            problems.append(f"[data] {name!r}{where}: a source's name has no '=', ',' or ':'")
        parts.append(f"{name}={d}:{w!r}")
    if not problems and not total > 0:
        problems.append(f"[data]{where}: the weights sum to zero; give at least one > 0")
    if problems:
        raise ConfigError(problems)
    return ",".join(parts)


def load_toml(path: str | Path) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """Read a TOML file with optional [model], [parallel] and [train] tables.

    ``[model]`` may name a preset (``name = "llama3-8b"``) and override any of its fields.
    """
    model, par, train, _ = read_toml(path)
    return model, par, train


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def dump_toml(model: ModelConfig, par: ParallelConfig, train: TrainConfig) -> str:
    out = []
    for section, obj in (("model", model), ("parallel", par), ("train", train)):
        out.append(f"[{section}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in dataclasses.asdict(obj).items()]
        out.append("")
    return "\n".join(out)


def as_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


__all__ = [
    "ConfigError", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "DIMS", "AUTO",
    "auto_precision", "resolve_precision", "precision_of",
    "DEFAULT_WORLD", "preset", "validate", "check_values", "check_field", "check_count",
    "check_outputs", "fill_dp", "hybrid_problems", "flag_of", "read_toml", "load_toml",
    "dump_toml", "as_dict", "mixture_spec",
    "field",
]
