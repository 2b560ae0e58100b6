"""The shared frame of the optimizers that are not elementwise (``rownorm``, ``adafactor``,
``muon``): they step the owned fp32 masters of every bucket from the owned reduced gradients,
like ``FlatAdamW``, but read the ``Piece`` table (``fived.optim.pieces``) to know which rows,
columns and matrices the owned elements belong to.

Contract with the data-parallel engine (``fived.parallel.data.master.MasterStep``, docs/engine.md):

* ``step(grads, lr)``: ``grads[i]`` is bucket i's owned reduced gradient (the same slice as
  ``masters[i]``), already clipped and unscaled;
* ``flat_state(i)``: the state tensors laid out like bucket i's owned shard (they carry its
  padding); ``state_bytes()``: every state tensor held; ``state_dict()``: all of them by name.

Weight decay is decoupled (θ ← θ − lr·λ·θ before the update), as in AdamW.
"""

from __future__ import annotations

from typing import Any

import torch

from .pieces import BucketPieces, Piece


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class ShardedOptimizer:
    name = ""
    flat_names: tuple[str, ...] = ()  # what ``flat_state(i)`` holds, by name (checkpoints)
    # ``extra_state()`` keys are ``S.BUCKET.PARAM``; per S: "owned" (the owned elements of the
    # piece), "rows"/"cols" (one value per row/column of the local matrix) (checkpoints)
    state_kinds: dict[str, str] = {}

    def __init__(self, masters: list[torch.Tensor], buckets: list[BucketPieces], grid: Any,
                 train: Any, aligned_rows: bool = False):
        self.params = masters
        self.buckets = buckets
        self.grid = grid
        self.beta1, self.beta2, self.eps, self.wd = (train.beta1, train.beta2, train.eps,
                                                     train.weight_decay)
        self.aligned_rows = aligned_rows
        self.t = 0

    def owned(self):
        """(bucket, piece, master slice, index in bucket) for every owned piece."""
        for b in self.buckets:
            for p in b.pieces:
                if p.owned:
                    yield b, p, self.params[b.index][p.lo:p.hi]

    def decay(self, theta: torch.Tensor, lr: float) -> None:
        if self.wd:
            theta.mul_(1 - lr * self.wd)

    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        raise NotImplementedError

    def flat_state(self, i: int) -> list[torch.Tensor]:
        return []

    def extra_state(self) -> dict[str, torch.Tensor]:
        """State tensors that are not laid out like a shard, by name."""
        return {}

    def state_bytes(self) -> int:
        flat = [t for i in range(len(self.params)) for t in self.flat_state(i)]
        return nbytes(flat) + nbytes(list(self.extra_state().values()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i in range(len(self.params)):
            for k, t in enumerate(self.flat_state(i)):
                out[f"flat{k}.{i}"] = t
        out.update(self.extra_state())
        out["t"] = torch.tensor(self.t)
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, t in self.state_dict().items():
            if k != "t":
                t.copy_(sd[k])
        self.t = int(sd["t"])


def key(b: BucketPieces, p: Piece) -> str:
    return f"{b.index}.{p.name}"
