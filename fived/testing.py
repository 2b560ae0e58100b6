"""Test helpers: run a function on N gloo ranks, and train a layout for a parity comparison.

``run_ranks(fn, n, *args)`` spawns n processes (free port, timeout, the failing rank's
traceback in the exception) and returns each rank's return value. ``fn`` must be importable
(a module-level function) because ranks are spawned, not forked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .config import ModelConfig, ParallelConfig, TrainConfig
from .dist.launch import run_local


def run_ranks(fn: Callable, n: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    return run_local(fn, n, args, timeout=timeout, collective_timeout=min(timeout, 120.0))


def _train(rank: int, world: int, model: ModelConfig, par: ParallelConfig,
           train: TrainConfig) -> dict[str, Any]:
    from .train.trainer import train_rank

    return train_rank(rank, world, model, par, train, show=False)


def train_layout(model: ModelConfig, par: ParallelConfig, train: TrainConfig,
                 timeout: float = 300.0) -> list[dict[str, Any]]:
    """Train ``par`` on ``par.world_size`` local ranks; every rank's summary."""
    return run_ranks(_train, par.world_size, model, par, train, timeout=timeout)


def rel_diff(a: list[float], b: list[float]) -> float:
    """Largest relative difference between two equal-length sequences."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def small_train(**kw: Any) -> TrainConfig:
    base = TrainConfig(steps=5, global_batch=8, lr=3e-3, warmup=2, seed=7)
    return replace(base, **kw)
