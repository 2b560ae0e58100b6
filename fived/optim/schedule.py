"""The learning-rate schedule: linear warm-up, then cosine decay to ``min_ratio · lr``.

    lr(s) = lr · (s + 1) / W                                            s < W  (warm-up steps W)
    lr(s) = lr · (r + (1 − r) · ½ (1 + cos(π · min(1, (s − W) / (T − W)))))   s ≥ W

(T = total steps, r = ``min_ratio``; T ≤ W: the peak ``lr`` after warm-up.)
"""

from __future__ import annotations

import math


def lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio · lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if steps <= warmup:
        return lr
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
