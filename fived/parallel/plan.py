"""The plan: the factory through which the model receives its (parallel) layers.

The model asks the plan for each piece — a column- or row-cut linear, the embedding, the head
and loss, the attention core, the expert block — and the plan returns the one-rank reference or
the parallel version for this rank's groups. The model itself holds no parallel logic: it only
knows the local head counts (``heads // tp``) the plan tells it.

Dimensions plug in here:
* tensor parallelism (``fived.parallel.tensor``) replaces ``column``, ``row``, ``embedding``,
  ``head`` and ``loss`` when tp > 1, with sequence parallelism when ``sequence_parallel``;
* context parallelism (``fived.parallel.context``) replaces ``attention`` when cp > 1;
* expert parallelism (``fived.parallel.expert``) provides the MoE dispatch when ep > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig, ParallelConfig
from ..model import layers as L


@dataclass
class Plan:
    """Reference plan (one rank). Subclasses or group fields switch in the parallel layers."""

    model: ModelConfig
    par: ParallelConfig
    seed: int
    grid: Any = None  # fived.dist.grid.Grid (None: one rank)
    dtype: torch.dtype = torch.float32
    # d(step loss)/d(local loss sum) = 1/global_tokens, set by the trainer each step; MoE layers
    # give their auxiliary losses this gradient (fived.model.moe._AuxGrad).
    loss_scale: float = 1.0

    # --------------------------------------------------------------- groups
    def group(self, name: str) -> Any:
        return None if self.grid is None else self.grid[name]

    @property
    def tp(self) -> int:
        return 1 if self.grid is None else self.grid.degrees["tp"]

    @property
    def tp_rank(self) -> int:
        return 0 if self.grid is None else self.grid.coords()["tp"]

    def local_heads(self) -> tuple[int, int]:
        """(query heads, kv heads) held by this tp rank; kv heads replicate when tp > kv_heads."""
        m = self.model
        return m.heads // self.tp, max(1, m.kv_heads // self.tp)

    # --------------------------------------------------------------- layers
    def column(self, name: str, in_f: int, out_f: int, std: float, shards: int | None = None
               ) -> nn.Module:
        """A linear whose output features are cut across tp (``shards`` chunks, replicated
        tp/shards times when shards < tp)."""
        if self.tp > 1:
            from . import tensor

            return tensor.ColumnLinear(self, name, in_f, out_f, std, shards or self.tp)
        return L.Linear(name, in_f, out_f, std, self.seed, dtype=self.dtype)

    def row(self, name: str, in_f: int, out_f: int, std: float) -> nn.Module:
        """A linear whose input features are cut across tp; its output is reduced."""
        if self.tp > 1:
            from . import tensor

            return tensor.RowLinear(self, name, in_f, out_f, std)
        return L.Linear(name, in_f, out_f, std, self.seed, dtype=self.dtype)

    def norm(self, name: str, hidden: int) -> nn.Module:
        norm = L.RMSNorm(name, hidden, self.model.norm_eps, dtype=self.dtype)
        if self.tp > 1 and self.par.sequence_parallel:  # runs on the sequence shard
            from . import tensor

            tensor.mark_norm(self, norm)
        return norm

    def embedding(self, name: str, std: float) -> nn.Module:
        if self.tp > 1:
            from . import tensor

            return tensor.VocabEmbedding(self, name, self.model.vocab, self.model.hidden, std)
        return L.Embedding(name, self.model.vocab, self.model.hidden, std, self.seed, self.dtype)

    def head(self, name: str, std: float) -> nn.Module:
        """The output projection hidden -> vocab (vocab-cut across tp)."""
        if self.tp > 1:
            from . import tensor

            return tensor.VocabHead(self, name, self.model.hidden, self.model.vocab, std)
        return L.Linear(name, self.model.hidden, self.model.vocab, std, self.seed,
                        dtype=self.dtype)

    def tied_logits(self, h: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """Logits from the (vocab-cut) embedding matrix: tied input and output embeddings."""
        if self.tp > 1:
            from . import tensor

            return tensor.vocab_logits(self, h, embed.weight)
        return torch.nn.functional.linear(h, embed.weight)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies over this rank's tokens (vocab-parallel when tp > 1)."""
        if self.tp > 1:
            from . import tensor

            return tensor.vocab_parallel_loss(logits, targets, self.group("tp"))
        return L.token_losses(logits, targets)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over the whole sequence; q/k/v (b, s_local, heads_local, d)."""
        if self.grid is not None and self.grid.degrees["cp"] > 1:
            from . import context

            return context.attention(self, q, k, v)
        return L.causal_attention(q, k, v)

    # --------------------------------------------------------------- regions
    def enter_blocks(self, h: torch.Tensor) -> torch.Tensor:
        """After the embedding: hook for dimensions that reshape the residual stream."""
        return h

    def exit_blocks(self, h: torch.Tensor) -> torch.Tensor:
        return h
