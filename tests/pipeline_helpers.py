"""Rank functions shared by the pipeline tests (spawned ranks need importable functions)."""

from __future__ import annotations

from typing import Any

import torch

from fived.config import ModelConfig, ParallelConfig, TrainConfig


def train_many(rank: int, world: int, model: ModelConfig, pars: list[ParallelConfig],
               train: TrainConfig) -> list[dict[str, Any]]:
    """Train several layouts of the same world size in one spawn (saves process start-ups);
    each summary holds this rank's first-step gradient pieces (``fived.testing.assemble_grads``
    joins the ranks')."""
    from fived.testing import train_recording

    return [train_recording(rank, world, model, par, train) for par in pars]


def grads_one_step(rank: int, world: int, model: ModelConfig, par: ParallelConfig,
                   train: TrainConfig) -> dict[str, Any]:
    """One step's reduced gradient pieces with their placements (``fived.testing.grad_pieces``),
    this rank's local loss, the executor's stats."""
    from fived.testing import grad_pieces
    from fived.train.trainer import Trainer

    torch.manual_seed(train.seed)
    t = Trainer(model, par, train, rank, world)
    x, y, pos = t.local_data(0)
    t.engine.zero_grad()
    loss = t.forward_backward(x, y, pos, 1.0 / (train.global_batch * model.seq_len))
    t.engine.finish()
    grads = grad_pieces(t)
    stats = t.executor.stats if t.executor is not None else {}
    return {"grads": grads, "loss": float(loss), "stats": stats,
            "traffic": t.traffic.as_dict()}


def timed_run(rank: int, world: int, model: ModelConfig, par: ParallelConfig,
              train: TrainConfig, delay: dict[str, float], steps: int) -> list[dict[str, Any]]:
    """Run ``steps`` pipeline steps with a sleep-dominated stage cost; every step's stats (the
    figure of part 7 measures its bubbles with the same function)."""
    from fived.viz.bubbles import timed_rank

    return timed_rank(rank, world, model, [(par, delay, steps)], train)[0]


def suite(rank: int, world: int, model: ModelConfig, pars: list[ParallelConfig],
          train: TrainConfig, grad_pars: list[ParallelConfig] = (),
          timed: list[tuple[ParallelConfig, dict[str, float], int]] = ()) -> dict[str, Any]:
    """Everything one world size tests, in one spawn: trained layouts, one-step gradients and
    sleep-timed runs."""
    return {"train": train_many(rank, world, model, pars, train),
            "grads": [grads_one_step(rank, world, model, p, train) for p in grad_pars],
            "timed": [timed_run(rank, world, model, p, train, d, n) for p, d, n in timed]}
