"""Configs: the model, the layout and the run, plus presets, validation and TOML.

Three dataclasses describe everything fived needs:

* ``ModelConfig``  — the shape of a Llama-style decoder (optionally MoE).
* ``ParallelConfig`` — the layout ``pp × dp × ep × cp × tp`` and how each dimension runs.
* ``TrainConfig``  — the optimisation run (steps, global batch, learning rate, seed ...).

``validate`` checks every constraint at once and raises one ``ConfigError`` that lists each
broken constraint with a suggested fix, so a bad layout is rejected before any process starts.
The ledger imports this module only: it must stay free of ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"
    vocab: int = 256
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 176
    seq_len: int = 64
    rope_theta: float = 10000.0
    tied_embeddings: bool = False
    norm_eps: float = 1e-5
    # Mixture of experts: experts == 0 means a dense model.
    experts: int = 0
    top_k: int = 2
    moe_ffn: int = 0  # 0: same as ffn
    shared_expert: bool = False
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "tiny-moe": ModelConfig(name="tiny-moe", ffn=96, experts=4, top_k=2),
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
}

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
CP_MODES = ("ring", "ulysses")
DIMS = ("pp", "dp", "ep", "cp", "tp")  # outermost ... innermost (the default grid order)


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "fp32"
    grad_reduce_dtype: str = "fp32"  # fp32 | bf16 (the dtype gradients are reduced in)
    cp_mode: str = "ring"
    order: tuple[str, ...] = DIMS
    bucket_mb: float = 25.0
    overlap: bool = True
    pp_layers: tuple[int, ...] = ()  # a hand split of layers per (virtual) stage; () = balanced

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.cp * self.tp

    def degree(self, dim: str) -> int:
        return int(getattr(self, dim))

    def describe(self) -> str:
        parts = [f"{d}{self.degree(d)}" for d in DIMS if self.degree(d) > 1] or ["1 rank"]
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.sequence_parallel:
            parts.append("sp")
        return "·".join(parts)


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny"
    steps: int = 50
    global_batch: int = 16  # sequences per optimizer step, whatever the layout
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    corpus_mb: float = 4.0
    metrics_out: str = ""
    log_every: int = 1


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError([f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}"])
    return PRESETS[name]


def _divides(problems: list[str], a: int, b: int, what: str, fix: str) -> None:
    if a <= 0 or b % a != 0:
        problems.append(f"{what}: {b} is not divisible by {a}; {fix}")


def validate(
    model: ModelConfig,
    par: ParallelConfig,
    train: TrainConfig | None = None,
    world_size: int | None = None,
) -> None:
    """Raise ``ConfigError`` naming every broken constraint of this (model, layout, run)."""
    p: list[str] = []
    for dim in DIMS:
        if par.degree(dim) < 1:
            p.append(f"--{dim} must be >= 1 (got {par.degree(dim)})")
    if p:
        raise ConfigError(p)
    if world_size is not None and world_size != par.world_size:
        rest = par.world_size // par.dp
        hint = (
            f"use --dp {world_size // rest}"
            if world_size % rest == 0
            else f"choose degrees whose product is {world_size}"
        )
        p.append(
            f"world size {world_size} != pp·dp·ep·cp·tp = {par.pp}·{par.dp}·{par.ep}·{par.cp}·"
            f"{par.tp} = {par.world_size}; {hint}"
        )
    if sorted(par.order) != sorted(DIMS):
        p.append(f"grid order {par.order} must be a permutation of {DIMS}")
    if model.hidden % model.heads:
        p.append(f"hidden {model.hidden} is not divisible by heads {model.heads}")
    if model.heads % model.kv_heads:
        p.append(f"heads {model.heads} is not divisible by kv_heads {model.kv_heads}")
    if model.head_dim % 2:
        p.append(f"head_dim {model.head_dim} must be even for RoPE")
    tp = par.tp
    if tp > 1:
        _divides(p, tp, model.heads, "attention heads over tp", "pick a tp that divides the heads")
        if tp > model.kv_heads:
            _divides(
                p, model.kv_heads, tp, "tp over kv_heads (replicated kv heads)",
                "tp must be a multiple of kv_heads when it exceeds them",
            )
        else:
            _divides(p, tp, model.kv_heads, "kv heads over tp", "pick a tp dividing kv_heads")
        _divides(p, tp, model.ffn, "ffn over tp", "pick a tp dividing the ffn width")
        _divides(p, tp, model.vocab, "vocab over tp (vocab-parallel embedding)", "pad the vocab")
        if model.is_moe:
            _divides(p, tp, model.expert_ffn, "expert ffn over tp", "pick a tp dividing it")
    if par.sequence_parallel and tp == 1:
        p.append("--sequence-parallel needs --tp > 1")
    if par.sequence_parallel:
        _divides(
            p, tp * par.cp, model.seq_len, "seq_len over cp·tp (sequence parallelism)",
            "use a seq_len that cp·tp divides",
        )
    stages = par.pp * par.virtual_stages
    if par.pp_layers:
        if len(par.pp_layers) != stages or sum(par.pp_layers) != model.layers:
            p.append(
                f"--pp-layers {list(par.pp_layers)} must have pp·v = {stages} entries summing to "
                f"{model.layers} layers"
            )
    else:
        _divides(p, stages, model.layers, "layers over pp·virtual_stages", "use --pp-layers")
    if par.cp > 1:
        _divides(p, 2 * par.cp, model.seq_len, "seq_len over 2·cp (zigzag)", "pick seq_len")
        if par.cp_mode == "ulysses":
            _divides(
                p, par.cp, model.heads // max(tp, 1), "heads per tp rank over cp (ulysses)",
                "use --cp-mode ring or a cp dividing heads/tp",
            )
    if par.ep > 1 and not model.is_moe:
        p.append(f"--ep {par.ep} needs a MoE model (experts > 0); try --model tiny-moe")
    if model.is_moe:
        _divides(p, par.ep, model.experts, "experts over ep", "pick an ep dividing the experts")
        if not 1 <= model.top_k <= model.experts:
            p.append(f"top_k {model.top_k} must be in [1, experts={model.experts}]")
    if par.zero not in (0, 1, 2, 3):
        p.append(f"--zero must be 0, 1, 2 or 3 (got {par.zero})")
    if par.schedule not in SCHEDULES:
        p.append(f"--schedule {par.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if par.virtual_stages > 1 and par.schedule != "interleaved":
        p.append("--virtual-stages > 1 needs --schedule interleaved")
    if par.schedule == "interleaved" and par.pp > 1:
        if par.virtual_stages < 2:
            p.append("--schedule interleaved needs --virtual-stages >= 2")
        _divides(p, par.pp, par.micro_batches, "micro-batches over pp (interleaved)", "")
    if par.precision not in PRECISIONS:
        p.append(f"--precision {par.precision!r}: choose one of {', '.join(PRECISIONS)}")
    if par.grad_reduce_dtype not in ("fp32", "bf16"):
        p.append("grad_reduce_dtype must be fp32 or bf16")
    if par.recompute not in RECOMPUTE:
        p.append(f"--recompute {par.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
    if par.cp_mode not in CP_MODES:
        p.append(f"--cp-mode {par.cp_mode!r}: choose one of {', '.join(CP_MODES)}")
    if par.micro_batches < 1:
        p.append("--micro-batches must be >= 1")
    if train is not None:
        replicas = par.dp * par.ep
        if train.global_batch % replicas:
            p.append(
                f"global batch {train.global_batch} is not divisible by dp·ep = {replicas}; "
                f"use --global-batch {replicas * max(1, train.global_batch // replicas)}"
            )
        elif (train.global_batch // replicas) % par.micro_batches:
            p.append(
                f"sequences per replica {train.global_batch // replicas} are not divisible by "
                f"--micro-batches {par.micro_batches}"
            )
        if train.steps < 1:
            p.append("--steps must be >= 1")
    if p:
        raise ConfigError(p)


# ---------------------------------------------------------------- TOML in and out

_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}


def _coerce(cls: type, values: dict[str, Any], section: str) -> dict[str, Any]:
    known = {f.name: f for f in fields(cls)}
    out: dict[str, Any] = {}
    bad = [k for k in values if k not in known]
    if bad:
        raise ConfigError([f"[{section}] unknown key(s) {bad}; known: {sorted(known)}"])
    for k, v in values.items():
        out[k] = tuple(v) if isinstance(v, list) else v
    return out


def load_toml(path: str | Path) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """Read a TOML file with optional [model], [parallel] and [train] tables.

    ``[model]`` may name a preset (``name = "llama3-8b"``) and override any of its fields.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError([f"cannot read config {path}: {e}"]) from None
    extra = sorted(set(data) - set(_SECTIONS))
    if extra:
        raise ConfigError([f"unknown table(s) {extra} in {path}; use [model], [parallel], [train]"])
    train = TrainConfig(**_coerce(TrainConfig, data.get("train", {}), "train"))
    mvals = dict(data.get("model", {}))
    base = preset(mvals.get("name", train.model))
    model = replace(base, **_coerce(ModelConfig, mvals, "model"))
    par = ParallelConfig(**_coerce(ParallelConfig, data.get("parallel", {}), "parallel"))
    return model, par, replace(train, model=model.name)


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
    "ConfigError", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "DIMS",
    "preset", "validate", "load_toml", "dump_toml", "as_dict", "field",
]
