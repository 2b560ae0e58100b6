"""One way in: ``parallelize(model, grid, par, train)`` lays a plain model out on the grid.

The dimensions apply in one fixed order, each from its own file, each with the explicit group
it talks on (``grid[name]`` of a connected ``fived.ranks.grid.Grid``):

1. pipeline split (``pipeline/stage.py: split``) — this rank's chunks of the layer stack;
   then, on every chunk:
2. tensor + sequence parallelism (``tensor.py: apply_tp``, group ``tp``) — column/row cuts,
   vocab-parallel embedding, head and loss;
3. context parallelism (``context.py: apply_cp``, group ``cp``) — ring / Ulysses attention cores;
4. expert parallelism (``expert.py: apply_ep``, group ``ep``) — this rank's experts and the
   all-to-all dispatch;
   then fp8 products in the linear layers with ``--fp8`` (``fp8.py: apply_fp8``, its amax
   reduced over ``tp``);
5. activation recompute (``recompute.py: apply_recompute``);
6. data parallelism / ZeRO (``data/``, groups ``dense`` and ``expert``) — the engine that owns
   gradient buffers, reductions, master weights and the optimizer state;

and, with pp > 1, the executor that runs the schedule over the stage (``pipeline/runtime.py``).

Each step records what it did in the ``Placement`` of every parameter (global name, global
shape, which piece this rank holds, which groups its gradient is summed over): that table is the
only contract between the cut model and what comes after it (engines, gathered gradients, the
ledger check). The model never learns its layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..config import AUTO, auto_precision
from ..model.llama import Transformer, holds_embedding
from ..model.mtp import mtp_blocks
from .context import apply_cp
from .data import make_engine
from .expert import apply_ep
from .fp8 import apply_fp8
from .pipeline.runtime import PipelineExecutor, StageModel
from .pipeline.stage import split
from .placement import Placement, replicated
from .recompute import apply_recompute
from .tensor import apply_tp


@dataclass
class Parallelized:
    """What ``parallelize`` returns: this rank's model, its placements, engine and executor."""

    model: nn.Module  # the rank's model: the Transformer, or a StageModel of its pipeline chunks
    placements: dict[str, Placement]
    engine: Any  # fived.parallel.data engine (DDP / ZeRO-1/2/3)
    executor: PipelineExecutor | None  # pp > 1


def parallelize_parts(model: Transformer, grid: Any, par: Any
                      ) -> tuple[list[Transformer], dict[str, Placement]]:
    """Steps 1–5: this rank's chunks of ``model``, cut and wrapped, and their placements."""
    parts, _, placements = cut_parts(model, grid, par)
    return parts, placements


def cut_parts(model: Transformer, grid: Any, par: Any, cp_balance: str = "zigzag"
              ) -> tuple[list[Transformer], list[int], dict[str, Placement]]:
    """``parallelize_parts`` and the pipeline stage ids of the chunks ([0] without pp);
    ``cp_balance``: --cp-balance, the ring's sharding."""
    parts, ids = split(model, par, grid.coords()["pp"]) if par.pp > 1 else ([model], [0])
    placements: dict[str, Placement] = {}
    for part in parts:
        pl = replicated(part.named_parameters())
        apply_tp(part, grid["tp"], pl, par.sequence_parallel, par.overlap)
        apply_cp(part, grid["cp"], par.cp_mode, cp_balance)
        if part.cfg.is_moe:
            apply_ep(part, grid["ep"], pl, par.ep_dispatch)
        apply_fp8(part, grid["tp"], getattr(par, "fp8", "none"), grid["cp"])
        apply_recompute(part, par.recompute)
        placements.update(pl)
    embed_group(model.cfg, placements, grid)
    return parts, ids, placements


def embed_group(cfg: Any, placements: dict[str, Placement], grid: Any) -> None:
    """Megatron's embedding group: where the first and the last pipeline stage are two ranks
    and both hold the embedding (a tied head, multi-token prediction), each holds a copy of
    the same piece; its gradient, partial on each, is summed over ``embed`` (once per step,
    after the backward: ``fived.parallel.data.reduce``)."""
    name = "embed_tokens.weight"
    last_reads = holds_embedding(cfg, first=False, last=True)
    if name in placements and last_reads and grid["embed"].size > 1:
        pl = placements[name]
        placements[name] = replace(pl, grad_sum=pl.grad_sum + ("embed",),
                                   copies=grid["embed"].size)


def parallelize(model: Transformer, grid: Any, par: Any, train: Any, source: Any = None,
                device: Any = None) -> Parallelized:
    """Lay ``model`` out on ``grid``: a plain whole model, initialised, the same on every rank;
    or (born sharded) one built on the meta device, with ``source`` to fill this rank's pieces
    on ``device`` once they are cut (``fived.model.init.InitSource``, ``checkpoint.hf.HFSource``):
    nothing is allocated before the engine lays out the rank's own flat buffers."""
    parts, ids, placements = cut_parts(model, grid, par, train.cp_balance)
    if par.pp > 1:
        stage: nn.Module = StageModel(parts, ids)
        executor = PipelineExecutor(model.cfg, par, grid, stage, next(stage.parameters()).dtype)
    else:
        stage, executor = parts[0], None
    # ZeRO-3's gather units: the blocks (the MTP modules' blocks after the trunk's); with pp
    # the chunks (the executor gathers them)
    units = (list(stage.chunk_models) if par.pp > 1
             else [*stage.layers.values(), *mtp_blocks(stage)])
    engine = make_engine(stage, grid, par, train, placements, units, source, device)
    return Parallelized(stage, placements, engine, executor)


def dtype_of(precision: str) -> torch.dtype:
    """The compute dtype; ``auto`` (a layout no command resolved: the Python API) by the device
    the ranks get (``fived.config.auto_precision``: bf16 on cuda, fp32 on the cpu)."""
    if precision == AUTO:
        from ..ranks.launch import cuda_expected

        precision = auto_precision(cuda_expected())
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
