"""A MoE model's step hooks: its routing statistics (``RoutingStatistics``) and loss-free load
balancing (``balance = "bias"``, DeepSeek-V3 §2.1.2): the route balancer.

A MoE layer keeps only its selection bias ``route_bias`` (a buffer, added to the scores for the
choice of experts, never to their weights) and its ``RoutingStats``. The ``RouteBalancer`` owns
the rest, as a hook the trainer runs after every optimizer step, before the step's statistics
are collected (and reset):

1. the step's global routed counts c_{ℓ,e} of every bias layer ℓ on this rank — one all-reduce
   over ``batch`` (dp·ep) of int64, every step, so the traffic is the same whether or not the
   step was taken (``global_routed_counts``; bytes per rank 2·(n−1)/n·ℓ_bias·E·8, n = dp·ep);
2. if the step was taken (not an fp16 overflow or a non-finite loss), the update
   b_{ℓ,e} ← b_{ℓ,e} + γ · sign(c̄_ℓ − c_{ℓ,e}) (``update_route_bias``).

Its ``state_dict`` is the biases by their global names (``buffer.layers.L.block_sparse_moe.
route_bias``: whole and replicated, so any layout reads them), what a checkpoint stores.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm import ops
from ..model.moe import bias_layers, materialize_route_bias, route_bias_name, set_aux_grad_scale
from .expert import collect_stats


class RoutingStatistics:
    """A MoE model's per-step routing statistics as the trainer's step hooks: ``before_step``
    sets each layer's ``aux_grad_scale`` (d(step loss)/d(local aux sum)), ``record`` adds the
    step's ``moe`` entry (``fived.parallel.expert.collect_stats``: tokens per expert, dropped,
    aux losses, all-to-all share; one metrics all-gather over the world) and resets the layers'
    statistics — after the route balancer read them."""

    def __init__(self, model: nn.Module, cfg: Any, par: Any, placements: dict[str, Any],
                 world_group: Any, traffic: Any):
        self.model, self.cfg, self.par, self.placements = model, cfg, par, placements
        self.world_group, self.traffic = world_group, traffic

    def before_step(self, scale: float) -> None:
        set_aux_grad_scale(self.model, scale)

    def record(self, rec: dict[str, Any], seconds: float) -> None:
        rec["moe"] = collect_stats(self.model, self.cfg, self.par, self.placements,
                                   self.world_group, rec["tokens"], seconds, self.traffic)


class RouteBalancer:
    """balance = bias on one rank: its counters' collective, the update, the state."""

    def __init__(self, model: nn.Module, batch_group: Any, device: Any, rate: float,
                 source: Any = None):
        self.model, self.group, self.device, self.rate = model, batch_group, device, rate
        self.layers = bias_layers(model)
        materialize_route_bias(model, device)  # built on meta with the model: zeros here
        read = getattr(source, "buffer", None)  # --init-from: DeepSeek-V3's trained biases
        for m in self.layers if read is not None else ():
            saved = read(route_bias_name(m))
            if saved is not None:
                m.route_bias.copy_(saved)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def sync(self, stepped: bool) -> torch.Tensor:
        """The global counts (the collective, every step) and, if ``stepped``, the update."""
        counts = global_routed_counts(self.model, self.group, self.device)
        if stepped:
            update_route_bias(self.model, counts, self.rate)
        return counts

    def after_step(self, stepped: bool) -> dict[str, Any]:
        """The post-optimizer-step hook (``sync``): the record's ``routed`` (global counts) and
        ``route_bias`` (after the step) by layer."""
        counts = self.sync(stepped)
        return {"routed": {m.layer: r for m, r in zip(self.layers, counts.tolist())},
                "route_bias": {m.layer: m.route_bias.tolist() for m in self.layers}}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The biases by ``buffer.<global name>`` (the tensors themselves: a load writes them)."""
        return {f"buffer.{route_bias_name(m)}": m.route_bias for m in self.layers}


def global_routed_counts(model: nn.Module, batch_group: Any, device: Any) -> torch.Tensor:
    """(bias layers on this rank, E) int64: every layer's assignments before dropping over the
    whole global batch this step — one all-reduce over ``batch`` (dp·ep), charged to it.

    Why ``batch`` suffices: a rank's counts are of its *whole* sequences. Under cp (and tp with
    sequence parallelism) the layer has already summed each sequence's routed counts over the
    ranks that cut it (``reduce_counts``, for the balance loss), and without SP every tp rank
    routes the same tokens; so each member of a batch group holds the counts of its own
    sequences, the batch group's members together hold every sequence once, and each pipeline
    stage's batch groups reduce only the layers that stage holds. Integers: every rank gets the
    same bits, equal to the one-rank count."""
    counts = local_routed_counts(model, device)
    if counts.numel():
        ops.all_reduce(counts, batch_group)
    return counts


def local_routed_counts(model: nn.Module, device: torch.device | str = "cpu") -> torch.Tensor:
    """(bias layers, E) int64: this step's assignments before dropping, per expert, of this
    rank's whole sequences (``routed_per_expert``, summed over micro-batches); rows in
    ``bias_layers`` order."""
    layers = bias_layers(model)
    E = layers[0].cfg.experts if layers else 0
    out = torch.zeros(len(layers), E, dtype=torch.int64, device=device)
    for i, m in enumerate(layers):
        out[i] = m.stats.routed_per_expert.to(device)
    return out


def update_route_bias(model: nn.Module, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free update of every bias layer ℓ (row ℓ of ``counts``, the
    global assignments c_{ℓ,e} of this step, in ``bias_layers`` order):

        b_{ℓ,e} ← b_{ℓ,e} + γ · sign(c̄_ℓ − c_{ℓ,e}),    c̄_ℓ = (1/E) Σ_e c_{ℓ,e},   γ = ``rate``

    An underloaded expert's bias rises (it is chosen more), an overloaded one's falls. The sign
    is taken in integers, sign(Σ_e c_{ℓ,e} − E · c_{ℓ,e}), and the step is one fp32 add of ±γ,
    so equal counts give the same bits on every rank and every layout."""
    layers = bias_layers(model)
    assert counts.shape[0] == len(layers), (tuple(counts.shape), len(layers))
    with torch.no_grad():
        for m, c in zip(layers, counts):
            c = c.to(m.route_bias.device)
            step = torch.sign(c.sum() - m.cfg.experts * c).to(torch.float32)
            m.route_bias.add_(step, alpha=float(rate))
