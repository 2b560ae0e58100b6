"""The optimizer side of a step: flat shard-aware AdamW (``adamw``), the piece-aware optimizers
(``rownorm``, ``adafactor``, ``muon`` on ``pieces``/``sharded``), the learning-rate schedule
(``schedule``) and the global gradient norm / clipping (``clip``). Nothing here knows how the
gradients were reduced; the data-parallel engines (``fived.parallel.data``) call it."""

from typing import Any

from .adafactor import Adafactor
from .adamw import FlatAdamW
from .clip import accumulate_sq, clip_, clip_coef, model_parallel_sq, scale_
from .muon import Muon
from .pieces import BucketPieces, Piece, matrix_shape
from .rownorm import RowNorm
from .schedule import lr_at

OPTIMIZERS = ("adamw", "adafactor", "muon", "rownorm")
SHARDED = {"adafactor": Adafactor, "muon": Muon, "rownorm": RowNorm}


def make_optimizer(name: str, masters: list, buckets: list[BucketPieces], grid: Any,
                   train: Any, aligned_rows: bool = False) -> Any:
    """The optimizer ``name`` over the engine's owned fp32 masters (one per bucket)."""
    if name == "adamw":
        return FlatAdamW(masters, train.beta1, train.beta2, train.eps, train.weight_decay)
    if name not in SHARDED:
        raise ValueError(f"unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}")
    return SHARDED[name](masters, buckets, grid, train, aligned_rows=aligned_rows)


__all__ = ["OPTIMIZERS", "Adafactor", "BucketPieces", "FlatAdamW", "Muon", "Piece", "RowNorm",
           "accumulate_sq", "clip_", "clip_coef", "lr_at", "make_optimizer", "matrix_shape",
           "model_parallel_sq", "scale_"]
