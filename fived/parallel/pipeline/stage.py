"""The partition: the layer stack cut into S = pp·v (virtual) stages.

Stage 0 holds the embedding, stage S−1 the final norm, head and loss. The balanced split
minimises the largest stage cost, in forward FLOPs per token:

    layer   = 2·(attention + MLP parameters) + 4·seq·hidden     (QKᵀ and AV, causal ~ half of
                                                                 the full 2·2·s·h, kept full)
    head    = 2·hidden·vocab + 5·vocab                          (matmul + softmax/CE)
    embed   = hidden                                            (a lookup: ~free, but not 0)

by dynamic programming over contiguous splits (``balanced_split``, which is the ledger's, so
the planner and the runtime cut the same way). ``--pp-layers a,b,...``
gives the split by hand. Parameter names are global (``layers.5.attn.wq.weight``) and every
parameter is drawn from (seed, name), so any split builds the same model.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import ConfigError, ModelConfig, ParallelConfig
from ...ledger.params import balanced_split as _ledger_split
from ...model import build_model


def balanced_split(cfg: ModelConfig, stages: int) -> list[int]:
    """Layers per stage minimising the most expensive stage (ties: the most even split); the
    ledger's ``fived.ledger.params.balanced_split``, so the planner predicts the split we run."""
    try:
        return list(_ledger_split(cfg, stages))
    except ValueError:
        raise ConfigError([f"{stages} pipeline stages for {cfg.layers} layers: each stage needs "
                           "a layer"]) from None


def partition(cfg: ModelConfig, par: ParallelConfig) -> list[list[int]]:
    """Global layer ids of each (virtual) stage 0..S−1."""
    S = par.pp * par.virtual_stages
    counts = list(par.pp_layers) if par.pp_layers else balanced_split(cfg, S)
    if len(counts) != S or sum(counts) != cfg.layers or min(counts) < 0:
        raise ConfigError([f"--pp-layers {counts} must give {S} stages summing to {cfg.layers}"])
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


class StageModel(nn.Module):
    """This rank's model: its v chunks (stages r, r+p, ...) under global parameter names.

    The chunks are ``Transformer`` stages sharing their blocks with this container, whose
    ``embed`` / ``layers`` / ``norm`` / ``head`` give every parameter the name it has in the
    one-rank model. ``forward(x, positions, targets, chunk=c)`` runs chunk c.
    """

    def __init__(self, cfg: ModelConfig, plan, layer_ids: list[list[int]], stage_ids: list[int],
                 stages: int):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.stage_ids = stage_ids
        self.chunk_models = [build_model(cfg, plan, ids, first=s == 0, last=s == stages - 1)
                             for ids, s in zip(layer_ids, stage_ids)]
        self.first = self.chunk_models[0].first
        self.last = self.chunk_models[-1].last
        self.layer_ids = [i for ids in layer_ids for i in ids]
        if self.first:
            self.embed = self.chunk_models[0].embed
        self.layers = nn.ModuleDict()
        for c in self.chunk_models:
            for k, blk in c.layers.items():
                self.layers[k] = blk
        if self.last:
            self.norm = self.chunk_models[-1].norm
            self.head = self.chunk_models[-1].head

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                targets: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        return self.chunk_models[chunk](x, positions, targets)


def build_stage(cfg: ModelConfig, par: ParallelConfig, plan, pp_rank: int) -> StageModel:
    parts = partition(cfg, par)
    S = par.pp * par.virtual_stages
    ids = list(range(pp_rank, S, par.pp))
    return StageModel(cfg, plan, [parts[s] for s in ids], ids, S)
