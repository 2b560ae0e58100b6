"""Mixed precision: bf16/fp16 compute, fp32 master weights and optimizer state, fp16 loss scaling.

Policy (Micikevicius et al. 2018, "Mixed Precision Training"):

* the model is built in the compute dtype (``build_model(cfg, seed, dtype)``) — forward and
  backward run in it;
* every rank keeps an fp32 *master* copy of the parameters it updates (all of them with
  ZeRO-0, its 1/N shard with ZeRO-1/2/3); AdamW's m and v are fp32; after the step the master
  is rounded into the compute-dtype parameters;
* gradients are reduced and accumulated in fp32 by default (an fp32 gradient buffer, 18Ψ bytes
  of model state with ZeRO-0), or in the compute dtype with ``grad_reduce_dtype = "bf16"``
  (16Ψ bytes: 2 params + 2 grads + 4 master + 8 Adam);
* fp16 only: a dynamic loss scaler. The loss is multiplied by S in backward (an identity in
  forward, so the reported loss is unscaled), gradients are unscaled by 1/S before the global
  norm; a non-finite norm means an overflow somewhere: the step is skipped (``engine.step``
  returns False and says why in ``engine.skip_reason``; the trainer prints it and logs
  ``skipped``) and S halves; after ``growth_interval`` clean steps S doubles.

Without the fp32 master (``--master-weights``, bf16 only): the optimizer steps an fp32 *working
copy* made for the step and dropped after it, and the result is written back into the bf16
parameters by

* ``none``   round to nearest: an update smaller than half a bf16 ulp of the weight (2⁻⁹·|θ|)
             is lost — the measured "updates that round to zero";
* ``sr``     stochastic rounding: round up with probability (x − ⌊x⌋)/ulp, so the expected
             stored weight equals the fp32 result (unbiased; Gupta et al. 2015);
* ``kahan``  a bf16 compensation buffer c keeps what rounding dropped: the working copy is
             θ + c, after the step θ ← bf16(x), c ← bf16(x − θ) (Kahan summation, 2 bytes).

Master bytes per parameter: fp32 4, none/sr 0, kahan 2 (ZeRO shards them like the master).

This module is the policy only (which dtypes, whether a master copy exists, the scaler); the
engines in ``fived.parallel.data`` allocate by it. Bytes per parameter with ZeRO-0
(``bytes_per_param``; ZeRO-1/2/3 divide the sharded states by N):

    fp32:                 params 4 + grads 4                + Adam 8 = 16
    bf16/fp16, fp32 grad: params 2 + grads 4 + master 4     + Adam 8 = 18   (default)
    bf16/fp16, low grad:  params 2 + grads 2 + master 4     + Adam 8 = 16
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MASTER_WEIGHTS = ("fp32", "none", "sr", "kahan")


@dataclass(frozen=True)
class MasterPolicy:
    """``compute``: the parameters' dtype (forward and backward run in it); ``grad``: the dtype of
    the gradient buffers and their reductions; ``master``: ``fp32`` (an fp32 master copy exists
    unless ``compute`` is fp32 already: then the parameters are the master), or how bf16
    parameters are updated without one (``none``, ``sr``, ``kahan``)."""

    compute: torch.dtype
    grad: torch.dtype
    master: str = "fp32"

    @property
    def separate_master(self) -> bool:
        return self.compute != torch.float32 and self.master == "fp32"

    @property
    def in_place(self) -> bool:
        """Low-precision parameters updated through a transient fp32 working copy."""
        return self.compute != torch.float32 and self.master != "fp32"

    @classmethod
    def of(cls, compute: torch.dtype, grad_reduce_dtype: str, master: str = "fp32"
           ) -> MasterPolicy:
        """``grad_reduce_dtype = "fp32"`` (or fp32 compute): fp32 gradients; otherwise the
        compute dtype ("bf16" means "reduce in the compute dtype", fp16 under fp16)."""
        fp32 = grad_reduce_dtype == "fp32" or compute == torch.float32
        return cls(compute, torch.float32 if fp32 else compute, master)


def stochastic_round_bf16(x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16 rounding up with probability (x − trunc(x)) / ulp: add a uniform 16-bit
    integer to the fp32 bit pattern and truncate the low 16 bits."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, generator=gen)
    out = (bits + noise) & -65536  # 0xFFFF0000 as int32
    return out.view(torch.float32).to(torch.bfloat16)


def write_back(param: torch.Tensor, work: torch.Tensor, mode: str,
               comp: torch.Tensor | None = None, gen: torch.Generator | None = None
               ) -> torch.Tensor:
    """Store the stepped fp32 ``work`` into the low-precision ``param`` (in place) by ``mode``;
    returns a bool mask of the elements whose stored value did not change although ``work``
    moved (the updates lost to rounding)."""
    old = param.float() + (comp.float() if comp is not None else 0.0)
    moved = work != old
    if mode == "sr":
        param.copy_(stochastic_round_bf16(work, gen))
    else:
        param.copy_(work)
    if mode == "kahan" and comp is not None:
        comp.copy_(work - param.float())
    kept = param.float() + (comp.float() if comp is not None else 0.0)
    return moved & (kept == old)


class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 1000, min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.growth, self.backoff = growth, backoff
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by the current loss scale."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scaler: LossScaler) -> torch.Tensor:
        ctx.scale = scaler.scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g * ctx.scale, None


def install_loss_scaling(model: nn.Module, scaler: LossScaler) -> None:
    """Scale the backward of the model's scalar loss output (the last pipeline stage's)."""

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.dim() == 0 and out.requires_grad:
            return _ScaleGrad.apply(out, scaler)
        return out

    model.register_forward_hook(hook)


def loss_scaler(model: nn.Module, compute: torch.dtype) -> LossScaler | None:
    """fp16: a dynamic loss scaler, installed on ``model``'s loss; None for fp32 and bf16."""
    if compute != torch.float16:
        return None
    scaler = LossScaler()
    install_loss_scaling(model, scaler)
    return scaler


def bytes_per_param(precision: str, grad_reduce_dtype: str = "fp32",
                    master: str = "fp32") -> dict[str, int]:
    """What the engine allocates per parameter with ZeRO-0 (divide the sharded ones by N)."""
    if precision == "fp32":
        return {"params": 4, "grads": 4, "master": 0, "optimizer": 8}
    return {"params": 2, "grads": 4 if grad_reduce_dtype == "fp32" else 2,
            "master": {"fp32": 4, "kahan": 2}.get(master, 0), "optimizer": 8}
