"""Multi-token prediction (DeepSeek-V3 §2.2): D modules after the trunk, module k predicting the
token k+1 positions ahead, sharing the embedding E and the output head W_head with the trunk.

With tokens t (the inputs x and the targets y, y_i = t_{i+1}) and h⁰ = RMSNorm_final(h_L), the
trunk's normed output:

    h'ᵏ_i = W_ehᵏ [ RMSNorm_eᵏ(E[t_{i+k}]) ; RMSNorm_hᵏ(hᵏ⁻¹_i) ]         (2h -> h)
    hᵏ    = RMSNorm_outᵏ( Blockᵏ(h'ᵏ) )                                 (one transformer block)
    Lᵏ    = Σ_{i : i+k < S} CE(W_head hᵏ_i, t_{i+1+k})
    loss  = L⁰ + λ/D · Σ_k Lᵏ                                           (L⁰: the trunk's)

Every Lᵏ is a sum over tokens, divided by the same global token count as the trunk's (fived's
loss convention): DeepSeek's 1/T · Σ_{i=2+k}^{T+1}, so the last k positions of a sequence, whose
target lies beyond it, add nothing. The concatenation puts the embedding first (the order of
DeepSeek's released ``eh_proj`` and of Megatron-Core; the report's equation writes h first),
and every module has its own output norm (``shared_head.norm`` in DeepSeek's weights,
``final_layernorm`` in Megatron-Core); the head itself and the embedding are the trunk's.
hᵏ⁻¹ is the previous module's normed output (h⁰ the trunk's, after the final norm), as in
both.

Module k reads the token t_{i+k} = y_{i+k−1} and the target t_{i+1+k} = y_{i+k}: everything it
needs is the targets, shifted, so a pipeline's last stage (which has the targets) runs the
modules. ``Ahead`` gives, for every local position, the targets 0..D positions ahead and
whether they exist; on one rank a shift of the local rows, under context parallelism a module
of ``fived.parallel.context`` that fetches the heads of the successor chunks.

The targets may carry marks above their token id that the data pipeline adds for the loss
(``fived.data.vocab``: ``--eos-target ignore``'s skip bit 2³¹, a mixture's source from bit 32):
a module embeds the token id alone (``TOKEN_ID``, the low 31 bits) and hands its targets,
marks and all, to the loss, so a module skips the targets the trunk skips. A loss that tallies
per source (``untallied``) is asked for its untallied form: a mixture's per-source losses are
the trunk's, as the step's ``loss`` is.

With document masks (``--doc-mask``: packed documents, each attending to itself) a module's
target counts only where the position k ahead lies in the token's own document: module k
reads no token and predicts no target of another document, as the trunk's attention sees
none (Megatron-Core's ``roll_tensor`` rolls each packed sequence on its own the same way).

The sequence keeps its length through every module (a position without a target gets the
target ``IGNORE``, which adds nothing to the loss), so tensor, sequence and context
parallelism cut a module exactly as a trunk block, and the vocab-parallel loss exchanges the
same per-token values on every rank. Evaluation and generation ignore the modules (they run
only where gradients are recorded: the objective of a training step);
``MultiTokenPrediction.tally`` keeps each micro-batch's Lᵏ, detached, for the step's report.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import layers as nn_layers

TOKEN_ID = (1 << 31) - 1  # a target's token id, below the data pipeline's marks


def ahead_of(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """(b, s, depth+1): [..., j] the targets j positions ahead (0 beyond the sequence)."""
    padded = F.pad(targets, (0, depth))
    return torch.stack([padded[:, j:j + targets.shape[1]] for j in range(depth + 1)], dim=-1)


def inside_of(pos: torch.Tensor, seq_len: int, depth: int, docs: torch.Tensor | None
              ) -> torch.Tensor:
    """Where module j's target exists for the tokens at global positions ``pos`` (n,): the
    position j ahead lies in the sequence, (n, depth+1); with document masks (``docs``, the
    rows' document ids (b, S)) also in the token's own document, (b, n, depth+1), as
    Megatron-Core rolls each packed sequence on its own (``roll_tensor``)."""
    ahead = pos[:, None] + torch.arange(depth + 1, device=pos.device)
    inside = ahead < seq_len
    if docs is not None:
        docs = docs.to(pos.device)
        inside = inside & (docs[:, ahead.clamp(max=seq_len - 1)] == docs[:, pos, None])
    return inside


class Ahead(nn.Module):
    """The targets 0..D positions ahead of each local position, and where they exist: the
    whole sequence is on this rank (context parallelism swaps in its fetching module)."""

    def forward(self, targets: torch.Tensor, docs: torch.Tensor | None, depth: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        s = targets.shape[1]
        pos = torch.arange(s, device=targets.device)
        return ahead_of(targets, depth), inside_of(pos, s, depth, docs)


def mtp_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model``'s multi-token prediction modules ([] without): the
    dimensions that act on every block (context, recompute) act on these too."""
    mtp = getattr(model, "mtp", None)
    return [m.block for m in mtp.modules_in_order()] if mtp is not None else []


class MTPModule(nn.Module):
    """One module: ``enorm``, ``hnorm``, ``eh_proj`` (2h -> h), the transformer ``block`` (built
    by the model: the trunk's block class at index layers + k) and its output ``norm``."""

    def __init__(self, hidden: int, eps: float, block: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.enorm = nn_layers.RMSNorm(hidden, eps, dtype)
        self.hnorm = nn_layers.RMSNorm(hidden, eps, dtype)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        self.block = block
        self.norm = nn_layers.RMSNorm(hidden, eps, dtype)

    def forward(self, h: torch.Tensor, e: torch.Tensor, rope: tuple) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, rope))


class MultiTokenPrediction(nn.Module):
    """The D modules (``0 .. D−1`` predict 2 .. D+1 tokens ahead), the ``Ahead`` lookup and the
    step's tally of each module's loss."""

    def __init__(self, hidden: int, eps: float, blocks: list[nn.Module], weight: float,
                 dtype: torch.dtype):
        super().__init__()
        self.depth, self.weight = len(blocks), weight
        for k, blk in enumerate(blocks):
            self.add_module(str(k), MTPModule(hidden, eps, blk, dtype))
        self.ahead = Ahead()
        self.reset()

    def modules_in_order(self) -> list[MTPModule]:
        return [self._modules[str(k)] for k in range(self.depth)]

    def reset(self) -> None:
        """A new step: nothing tallied."""
        self.tally = torch.zeros(self.depth, dtype=torch.float64)

    def forward(self, h0: torch.Tensor, targets: torch.Tensor, rope: tuple, embed: Callable,
                head: Callable, loss: Callable) -> torch.Tensor:
        """λ/D · Σ_k Lᵏ for one micro-batch (h0: the trunk's normed output, local shape);
        each Lᵏ, detached, is added to ``tally``."""
        docs = rope[2] if len(rope) > 2 else None  # --doc-mask: the rows' document ids
        ahead, inside = self.ahead(targets, docs, self.depth)
        loss = getattr(loss, "untallied", loss)  # a mixture's tallies are the trunk's alone
        total, h = None, h0
        losses = []
        for k, mod in enumerate(self.modules_in_order(), start=1):
            h = mod(h, embed((ahead[..., k - 1] & TOKEN_ID).contiguous()), rope)
            lk = loss(head(h), torch.where(inside[..., k], ahead[..., k], nn_layers.IGNORE))
            losses.append(lk.detach().double().reshape(1))
            total = lk if total is None else total + lk
        self.tally = self.tally.to(h0.device) + torch.cat(losses)
        return total * (self.weight / self.depth)
