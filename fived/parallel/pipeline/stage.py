"""The partition: the layer stack cut into S = pp·v (virtual) stages.

Stage 0 holds the embedding, stage S−1 the final norm, head and loss. The balanced split
minimises the largest stage cost, in forward FLOPs per token:

    layer   = 2·(attention + MLP parameters) + 4·seq·hidden     (QKᵀ and AV, causal ~ half of
                                                                 the full 2·2·s·h, kept full)
    head    = 2·hidden·vocab + 5·vocab                          (matmul + softmax/CE)
    embed   = hidden                                            (a lookup: ~free, but not 0)

by dynamic programming over contiguous splits (``balanced_split``, which is the ledger's, so
the planner and the runtime cut the same way). ``--pp-layers a,b,...``
gives the split by hand. ``split(model, par, pp_rank)`` cuts this rank's chunks out of a plain
model (``Transformer.part``); parameter names stay global (``layers.5.self_attn.q_proj.weight``),
so any split holds the same model. The chunks' container is ``runtime.StageModel``.
"""

from __future__ import annotations

from dataclasses import replace

from ...config import V_SCHEDULES, ConfigError, ModelConfig, ParallelConfig
from ...ledger.params import balanced_split as _ledger_split
from ...model.llama import Transformer


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


def stage_ids(par: ParallelConfig, pp_rank: int) -> list[int]:
    """The (virtual) stages of pipeline rank ``pp_rank``: r, r + pp, r + 2·pp, ...; with a
    V-shaped schedule (zb-v, dualpipe-v) r and 2·pp − 1 − r (``schedules.stage_rank``)."""
    if par.schedule in V_SCHEDULES:
        return sorted({pp_rank, 2 * par.pp - 1 - pp_rank})
    return list(range(pp_rank, par.pp * par.virtual_stages, par.pp))


def pipeline_layout(par: ParallelConfig) -> ParallelConfig:
    """The layout the pipeline runs: virtual stages count only for the interleaved and the
    V-shaped schedules."""
    keep = par.schedule in ("interleaved",) + V_SCHEDULES
    return replace(par, virtual_stages=par.virtual_stages if keep else 1)


def split(model: Transformer, par: ParallelConfig, pp_rank: int
          ) -> tuple[list[Transformer], list[int]]:
    """This rank's chunks of ``model``, one per virtual stage, in stage order, and the ids of
    those stages — for the layout the pipeline runs (``pipeline_layout``)."""
    par = pipeline_layout(par)
    ids = stage_ids(par, pp_rank)
    parts = partition(model.cfg, par)
    last = par.pp * par.virtual_stages - 1
    return [model.part(parts[s], s == 0, s == last) for s in ids], ids
