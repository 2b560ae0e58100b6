"""The optimizer side of a step: flat shard-aware AdamW (``adamw``), the learning-rate schedule
(``schedule``) and the global gradient norm / clipping (``clip``). Nothing here knows how the
gradients were reduced; the data-parallel engines (``fived.parallel.data``) call it."""

from .adamw import FlatAdamW
from .clip import accumulate_sq, clip_, clip_coef, model_parallel_sq, scale_
from .schedule import lr_at

__all__ = ["FlatAdamW", "accumulate_sq", "clip_", "clip_coef", "lr_at", "model_parallel_sq",
           "scale_"]
