"""A rank's model for inference, born sharded: built on meta, cut by tensor parallelism, then
each parameter filled with this rank's piece only.

``inference_model(cfg, grid, source, device, dtype)`` runs the same cut as training
(``fived.parallel.parallelize.parallelize_parts``: tensor parallelism over ``grid["tp"]``; pp,
cp and ep of one) but no engine: no gradient buffers, master weights or optimizer state, so a
rank holds its parameters' pieces and nothing else. ``source`` is anything with
``fill(out, name, shape, dim, parts, index)``: ``fived.checkpoint.convert.CheckpointSource``
(a fived checkpoint, read with DCP box by box), ``fived.checkpoint.hf.HFSource`` (safetensors
slices) or ``fived.model.init.InitSource`` (a fresh draw).

With ``balance = bias`` each MoE layer's selection bias ``route_bias`` (a buffer, not a
parameter) is the trained one: read whole with ``source.buffer(name)`` where the source has it
(a fived checkpoint), else zero (a fresh draw; Hugging Face models have none).

MoE layers run dropless here (``capacity_factor = 0``): capacity is per sequence, and a decode
step's "sequence" is one token, so a capacity would drop what training kept.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig, ParallelConfig
from ..model import build_model
from ..model.llama import Transformer
from ..model.moe import bias_layers, materialize_route_bias, moe_layers, route_bias_name
from ..parallel.parallelize import parallelize_parts


def inference_model(cfg: ModelConfig, grid: Any, source: Any, device: torch.device | str,
                    dtype: torch.dtype = torch.float32) -> Transformer:
    """This rank's tensor-parallel piece of the model, in ``dtype`` on ``device``, in eval mode
    and without gradients; without multi-token prediction's modules (a training objective:
    generation neither builds nor reads them)."""
    cfg = replace(cfg, capacity_factor=0.0) if cfg.is_moe else cfg
    cfg = replace(cfg, mtp_depth=0)
    par = ParallelConfig(tp=grid.degrees["tp"])
    model = build_model(cfg, 0, dtype, "meta", init=False)
    parts, placements = parallelize_parts(model, grid, par)
    model = parts[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            pl = placements[name]
            t = torch.empty(p.shape, dtype=dtype, device=device)
            source.fill(t, pl.name, pl.shape, pl.dim, pl.parts, pl.index)
            # the module keeps its Parameter object (shared references stay shared), off meta
            torch.utils.swap_tensors(p, nn.Parameter(t, requires_grad=False))
    for moe in moe_layers(model):  # its statistics were made on meta
        moe.reset_stats()
    materialize_route_bias(model, device)
    read = getattr(source, "buffer", None)
    for moe in bias_layers(model):
        saved = read(route_bias_name(moe)) if read is not None else None
        if saved is not None:
            moe.route_bias.copy_(saved)
    return model.eval()


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
