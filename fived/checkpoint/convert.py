"""One-process conversions: a fived checkpoint -> whole tensors (``fived export``), a Hugging
Face directory -> a fived checkpoint (``fived import``), and what ``fived checkpoint inspect``
reads. DCP reads any checkpoint into whole tensors on one process (``no_dist``): the boxes
every rank wrote are simply all intersected with the whole tensor."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..config import ModelConfig, ParallelConfig, TrainConfig
from . import hf
from . import storage as S
from .state import LoadPlanner, SavePlanner, tensor_table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape (a model on the meta device: nothing allocated)."""
    from ..model.llama import Transformer

    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}


def model_of(man: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**man["config"]["model"])


def whole_model(ckpt: Path, man: dict[str, Any], dtype: torch.dtype | None = None
                ) -> dict[str, torch.Tensor]:
    """Every parameter of checkpoint ``ckpt`` whole, by fived name: the fp32 master where the
    checkpoint has one, else the saved parameter (plus Kahan's c where saved); cast to
    ``dtype`` (None: as saved)."""
    tensors = man["tensors"]
    names = sorted(k[len("model."):] for k in tensors if k.startswith("model."))
    dest = {}
    for n in names:
        src = f"master.{n}" if f"master.{n}" in tensors else f"model.{n}"
        meta = tensors[src]
        dest[src] = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]))
        if f"comp.{n}" in tensors:  # --master-weights kahan: θ + c is the value it stands for
            dest[f"comp.{n}"] = torch.empty(meta["shape"], dtype=torch.float32)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(dest, storage_reader=S.safe_reader(ckpt), planner=LoadPlanner(), no_dist=True)
    saved = getattr(torch, tensors[f"model.{names[0]}"]["dtype"]) if names else torch.float32
    out = {}
    for n in names:
        t = dest[f"master.{n}"] if f"master.{n}" in dest else dest[f"model.{n}"]
        if f"comp.{n}" in dest:
            t = t.float() + dest[f"comp.{n}"]
        out[n] = t.to(dtype or saved)
    return out


def import_hf(hf_dir: str | Path, save_dir: str | Path, seq_len: int | None = None,
              dtype: str = "fp32") -> tuple[Path, ModelConfig, dict[str, Any]]:
    """A Hugging Face directory -> ``save_dir/step-000000`` (parameters only: the optimizer
    starts fresh on resume); (the checkpoint, its model config, its tensors table)."""
    cfg = hf.model_config(hf.read_config(hf_dir, "fived import"), "fived import", seq_len)
    shapes = param_shapes(cfg)
    tensors = hf.read_tensors(hf_dir)
    if cfg.tied_embeddings:
        tensors.pop("lm_head.weight", None)
    from ..config import ConfigError

    bad = [f"{n}: {tuple(tensors[n].shape)} in {hf_dir}, config.json implies {s}"
           for n, s in shapes.items() if n in tensors and tuple(tensors[n].shape) != s]
    bad += [f"{n}: missing from {hf_dir}" for n in shapes if n not in tensors]
    bad += [f"{n}: in {hf_dir}, not in a {cfg.name} model" for n in tensors if n not in shapes]
    if bad:
        raise ConfigError([f"fived import {hf_dir}: tensors do not match config.json:"] + bad[:40])
    state = {f"model.{n}": tensors[n].to(DTYPES[dtype]).contiguous() for n in shapes}
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    S.clean_tmp(root)
    tmp = S.tmp_dir(root, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=SavePlanner(),
                 no_dist=True)
    man = {"family": "fived", "step": 0, "world": 1, "imported_from": str(hf_dir),
           "config": {"model": asdict(cfg), "parallel": asdict(ParallelConfig(precision=dtype)),
                      "train": asdict(TrainConfig(model=cfg.name))},
           "optimizer": None, "loss_scaler": None, "data": {}, "memory_per_rank": [],
           "tensors": tensor_table(tmp)}
    return S.finalize(root, 0, man), cfg, man["tensors"]
