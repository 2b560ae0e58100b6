"""Activation recompute: keep fewer activations, run (part of) the forward again in backward.

* ``full``: each transformer block keeps only its input; its whole forward reruns during the
  backward (Chen et al. 2016). Saved activations per block drop to b·s·h; compute grows by one
  forward per block (≈ +33 % of the step's FLOPs).
* ``selective``: only the attention core (softmax(qkᵀ)v) is recomputed (Korthikanti et al.
  2022): its O(s²)-sized intermediates are not stored, while the cheap-to-store, expensive-to-
  recompute matmuls keep their outputs.

Applied to a plain model by wrapping the module's forward in ``torch.utils.checkpoint``
(non-reentrant), so parameter names do not change. Module hooks (ZeRO-3's gather/free) run
around the checkpointed call, once per forward; a recomputation happens inside the backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model.mtp import mtp_blocks


def _checkpointed(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False)
        return inner(*args)

    module.forward = forward


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """``mode``: none | selective (attention cores) | full (whole blocks)."""
    if mode == "none":
        return model
    for block in [*model.layers.values(), *mtp_blocks(model)]:
        _checkpointed(block if mode == "full" else block.self_attn.core)
    return model
