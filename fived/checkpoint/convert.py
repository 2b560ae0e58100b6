"""One-process conversions: a fived checkpoint -> whole tensors (``fived export``), a Hugging
Face directory -> a fived checkpoint (``fived import``), and what ``fived checkpoint inspect``
reads. DCP reads any checkpoint into whole tensors on one process (``no_dist``): the boxes
every rank wrote are simply all intersected with the whole tensor."""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..config import ModelConfig, ParallelConfig, TrainConfig
from . import hf, storage
from .hf import param_shapes  # noqa: F401 - re-exported (cli.train, tests)
from .pieces import Pieces
from .state import LoadPlanner, SavePlanner, tensor_table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_of(man: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**man["config"]["model"])


def whole_model(ckpt: Path, man: dict[str, Any], dtype: torch.dtype | None = None,
                names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Parameters ``names`` (default: every one) of checkpoint ``ckpt`` whole, by fived name:
    the fp32 master where the checkpoint has one, else the saved parameter (plus Kahan's c
    where saved); cast to ``dtype`` (None: as saved). DCP reads only the tensors asked for."""
    tensors = man["tensors"]
    every = param_names(man)
    names = every if names is None else names
    dest = {}
    for n in names:
        src, comp = value_keys(tensors, n)
        meta = tensors[src]
        dest[src] = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]))
        if comp:  # --master-weights kahan: θ + c is the value it stands for
            dest[comp] = torch.empty(meta["shape"], dtype=torch.float32)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(dest, storage_reader=storage.safe_reader(ckpt), planner=LoadPlanner(), no_dist=True)
    saved = getattr(torch, tensors[f"model.{every[0]}"]["dtype"]) if every else torch.float32
    out = {}
    for n in names:
        t = dest.pop(f"master.{n}") if f"master.{n}" in dest else dest.pop(f"model.{n}")
        if f"comp.{n}" in dest:
            t = t.float() + dest.pop(f"comp.{n}")
        out[n] = t.to(dtype or saved)
    return out


def value_keys(tensors: dict[str, Any], name: str) -> tuple[str, str | None]:
    """The saved tensors that make parameter ``name``'s value: the fp32 master where the
    checkpoint has one, else the saved parameter; and Kahan's compensation c, if saved."""
    src = f"master.{name}" if f"master.{name}" in tensors else f"model.{name}"
    return src, (f"comp.{name}" if f"comp.{name}" in tensors else None)


def param_names(man: dict[str, Any]) -> list[str]:
    return sorted(k[len("model."):] for k in man["tensors"] if k.startswith("model."))


def export_hf(ckpt: Path, man: dict[str, Any], out: Path, dtype: torch.dtype | None,
              max_shard_bytes: int, progress: Any = None) -> list[tuple[str, int, int]]:
    """``fived export``: the checkpoint as HF safetensors shards of at most ``max_shard_bytes``
    (a tensor larger than that gets a shard of its own, as transformers does), streamed: the
    shards are planned from the manifest's shapes, then each is read (DCP, only its tensors),
    written and dropped, so the process holds one shard at a time, never the whole model."""
    tensors = man["tensors"]
    saved = getattr(torch, tensors[f"model.{param_names(man)[0]}"]["dtype"])
    esize = torch.empty((), dtype=dtype or saved).element_size()
    sizes = {n: math.prod(tensors[f"model.{n}"]["shape"]) * esize for n in param_names(man)}
    cfg = model_of(man)
    alias = hf.mtp_aliases(cfg)  # MTP layers repeat the shared embedding and head
    sizes.update({a: sizes[src] for a, src in alias.items()})
    buffers = {}  # DeepSeek-V3 carries each MoE layer's selection bias (zeros if never trained)
    if hf.family(cfg) == "deepseek_v3":
        src = CheckpointSource(ckpt, man)
        for layer in range(cfg.first_dense_layers, cfg.layers):
            name = f"layers.{layer}.block_sparse_moe.route_bias"
            saved = src.buffer(name)
            buffers[name] = (saved if saved is not None
                             else torch.zeros(cfg.experts)).to(torch.float32)
            sizes[name] = buffers[name].numel() * 4
    shards = hf.plan_shards(sizes, max_shard_bytes)
    for i, names in enumerate(shards):
        params = [n for n in names if n not in buffers]
        got = whole_model(ckpt, man, dtype, sorted({alias.get(n, n) for n in params}))
        out_tensors = {n: got[alias[n]].clone() if n in alias else got[n]  # a copy:
                       for n in params}  # safetensors refuses shared storage
        out_tensors.update({n: buffers[n] for n in names if n in buffers})
        hf.write_shard(out_tensors, out, i, len(shards), cfg)
        if progress:
            progress(i + 1, len(shards))
    return hf.write_index(shards, sizes, cfg, out, str(dtype or saved).replace("torch.", ""))


def import_hf(hf_dir: str | Path, save_dir: str | Path, seq_len: int | None = None,
              dtype: str = "fp32") -> tuple[Path, ModelConfig, dict[str, Any]]:
    """A Hugging Face directory -> ``save_dir/step-000000`` (parameters only: the optimizer
    starts fresh on resume); (the checkpoint, its model config, its tensors table)."""
    cfg = hf.model_config(hf.read_config(hf_dir, "fived import"), "fived import", seq_len)
    shapes = param_shapes(cfg)
    src = hf.HFSource(hf_dir, cfg, "fived import")  # headers only; every mismatch refused
    # streamed: DCP's writer asks for one tensor at a time, read from the files only then
    state = {f"model.{n}": Pieces.lazy(s, DTYPES[dtype], lambda n=n: src.read(n))
             for n, s in shapes.items()}
    if cfg.is_moe and cfg.balance == "bias":  # the selection biases (DeepSeek-V3's), fp32
        state.update({f"buffer.{n}": src.buffer(n) for n in src.buffers})
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    storage.clean_tmp(root)
    tmp = storage.tmp_dir(root, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # one file per tensor: DCP's writer keeps every tensor of a file until the file is
        # written, so one file per rank would hold the whole model
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
        dcp.save(state, storage_writer=writer, planner=SavePlanner(), no_dist=True)
    man = {"family": "fived", "step": 0, "world": 1, "imported_from": str(hf_dir),
           "config": {"model": asdict(cfg), "parallel": asdict(ParallelConfig(precision=dtype)),
                      "train": asdict(TrainConfig(model=cfg.name))},
           "optimizer": None, "loss_scaler": None, "data": {}, "memory_per_rank": [],
           "tensors": tensor_table(tmp)}
    return storage.finalize(root, 0, man), cfg, man["tensors"]


class CheckpointSource:
    """A fived checkpoint read piece by piece (``fived generate --from``, born sharded): ``fill``
    has ``fived.model.init.InitSource``'s signature and reads, with DCP, only the box of
    chunk ``index`` of ``parts`` along ``dim`` — the fp32 master where the checkpoint has one,
    else the saved parameter (plus Kahan's c) — cast into ``out``."""

    def __init__(self, ckpt: str | Path, man: dict[str, Any]):
        self.ckpt, self.tensors = Path(ckpt), man["tensors"]

    def fill(self, out: torch.Tensor, name: str, shape: tuple[int, ...], dim: int = 0,
             parts: int = 1, index: int = 0) -> torch.Tensor:
        from ..model.init import piece_box

        box = piece_box(tuple(shape), dim, parts, index)
        offsets, sizes = tuple(a for a, _ in box), tuple(b - a for a, b in box)
        src, comp = value_keys(self.tensors, name)
        keys = [src] + ([comp] if comp else [])
        dest, got = {}, []
        for k in keys:
            dtype = getattr(torch, self.tensors[k]["dtype"])
            t = torch.empty(sizes, dtype=dtype)
            dest[k] = Pieces(tuple(self.tensors[k]["shape"]), dtype, [(offsets, t)])
            got.append(t)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(dest, storage_reader=storage.safe_reader(self.ckpt), planner=LoadPlanner(),
                     no_dist=True)
        value = got[0].float() + got[1] if len(got) > 1 else got[0]
        with torch.no_grad():
            return out.copy_(value.view(out.shape))

    def buffer(self, name: str) -> torch.Tensor | None:
        """Buffer ``name`` (e.g. a MoE layer's ``route_bias``) whole, as saved; None when the
        checkpoint has none (an aux_loss run, an import)."""
        key = f"buffer.{name}"
        if key not in self.tensors:
            return None
        meta = self.tensors[key]
        dest = {key: torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(dest, storage_reader=storage.safe_reader(self.ckpt), planner=LoadPlanner(),
                     no_dist=True)
        return dest[key]
