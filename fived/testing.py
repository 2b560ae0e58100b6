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
from .ranks.launch import run_local


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


def train_with_grads(model: ModelConfig, par: ParallelConfig, train: TrainConfig,
                     timeout: float = 300.0) -> tuple[list[float], dict[str, Any]]:
    """Train ``par``; (losses, every parameter's full first-step gradient by global name)."""
    run = train_runs([(model, par, train)], timeout=timeout)[0]
    return run["losses"], run["grads"]


def grad_pieces(trainer: Any) -> dict[str, tuple[dict[str, Any], Any]]:
    """Every parameter's reduced gradient piece on this rank with its placement (numpy: pickled
    by value across processes); ``assemble_grads`` joins the ranks'."""
    from dataclasses import asdict

    grads = trainer.engine.full_grads()
    return {n: (asdict(trainer.parallel.placements[n]), g.detach().float().cpu().numpy())
            for n, g in grads.items()}


class GradRecorder:
    """A run hook (``fived.train.hooks``): the first step's reduced gradient pieces."""

    def __init__(self) -> None:
        self.grads: dict[str, Any] = {}

    def on_grads(self, trainer: Any, step: int) -> None:
        if step == 0:
            self.grads.update(grad_pieces(trainer))


class OnGrads:
    """A run hook calling ``fn(trainer, step)`` once each step's gradients are reduced (to plant
    a NaN, or skip a step)."""

    def __init__(self, fn: Callable[[Any, int], None]):
        self.on_grads = fn


class DieAt:
    """A run hook: rank ``rank`` kills itself (SIGKILL) at the start of step ``steps[k]`` on
    torchrun's k-th attempt (``TORCHELASTIC_RESTART_COUNT``); ``tests/die_at.py R:S0,S1 train
    ...`` (the script torchrun runs) installs it in each rank, then runs fived's command line."""

    def __init__(self, spec: str):
        r, _, steps = spec.partition(":")
        self.rank, self.steps = int(r), [int(s) for s in steps.split(",") if s]

    def on_step_start(self, trainer: Any, step: int) -> None:
        import os
        import signal

        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if trainer.rank == self.rank and attempt < len(self.steps) and step == self.steps[attempt]:
            os.kill(os.getpid(), signal.SIGKILL)


def train_recording(rank: int, world: int, model: ModelConfig, par: ParallelConfig,
                    train: TrainConfig, hooks: tuple = ()) -> dict[str, Any]:
    """``train_rank`` with a ``GradRecorder``: the summary also holds ``grads``, this rank's
    first-step gradient pieces with their placements."""
    from .train.trainer import train_rank

    rec = GradRecorder()
    out = train_rank(rank, world, model, par, train, show=False, hooks=(rec, *hooks))
    out["grads"] = rec.grads
    return out


def rank_runs(rank: int, world: int, runs: list[tuple]) -> list[dict[str, Any]]:
    """On one rank: train each (model, layout, train) of ``runs``, recording the gradients."""
    return [train_recording(rank, world, m, p, t) for m, p, t in runs]


def gathered(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run from every rank's summary: ``ranks`` (the summaries, their gradient pieces
    removed), ``losses`` (rank 0's) and ``grads`` (every parameter's full first-step gradient)."""
    grads = assemble_grads([s.pop("grads") for s in ranks])
    return {"ranks": ranks, "losses": ranks[0]["losses"], "grads": grads}


def train_runs(runs: list[tuple[ModelConfig, ParallelConfig, TrainConfig]],
               timeout: float = 900.0) -> list[dict[str, Any]]:
    """[(model, layout, train)] of one world size, trained in one spawn (process start-ups
    dominate tiny runs) -> ``gathered`` each."""
    world = runs[0][1].world_size
    assert all(p.world_size == world for _, p, _ in runs), [p.describe() for _, p, _ in runs]
    per_rank = run_ranks(rank_runs, world, runs, timeout=timeout)
    return [gathered([per_rank[r][i] for r in range(world)]) for i in range(len(runs))]


def assemble_grads(per_rank: list[dict[str, tuple[dict[str, Any], Any]]]) -> dict[str, Any]:
    """Join the ranks' gradient pieces into full tensors by global name and shape.

    Each piece says which of ``parts`` chunks along ``dim`` it is; every chunk must be present,
    and ranks holding the same chunk (data-parallel or tp replicas) must agree exactly."""
    import torch

    pieces: dict[str, dict[int, Any]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for grads in per_rank:
        for name, (pl, g) in grads.items():
            g = torch.as_tensor(g)
            meta[name] = pl
            have = pieces.setdefault(name, {})
            if pl["index"] in have:
                assert torch.equal(have[pl["index"]], g), f"replicas of {name} differ"
            else:
                have[pl["index"]] = g
    out = {}
    for name, pl in meta.items():
        have = pieces[name]
        assert sorted(have) == list(range(pl["parts"])), f"{name}: pieces {sorted(have)}"
        full = torch.cat([have[i] for i in range(pl["parts"])], dim=pl["dim"])
        assert tuple(full.shape) == tuple(pl["shape"]), (name, full.shape, pl["shape"])
        out[name] = full
    return out


def grad_rel_diff(a: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest over parameters of ‖a − ref‖ / ‖ref‖ (the same names required)."""
    assert sorted(a) == sorted(ref), sorted(set(a) ^ set(ref))
    return max(float((a[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref)


def micro_step_evaluate(t: Any) -> float:
    """The validation loss as ``Trainer.evaluate`` computed it before it ran forward only
    (the reference of tests/test_eval.py and benchmarks/eval_forward_only.py): each batch a
    training micro-step, forward and backward with a zero loss scale, the gradients reduced
    and discarded, the MoE statistics reset."""
    from .model.moe import set_aux_grad_scale

    n = t.tcfg.eval_batches
    total = None
    set_aux_grad_scale(t.stage, 0.0)
    for k in range(n):
        x, y, positions = t.shard(*t.eval_loader.get(k))
        t.engine.zero_grad()
        loss = t.forward_backward(x, y, positions, 0.0)
        total = loss if total is None else total + loss
        t.engine.finish()
    t.engine.zero_grad()
    for m in t.stage.modules():
        if hasattr(m, "reset_stats"):
            m.reset_stats()
    return t.global_loss(total) / (n * t.tcfg.global_batch * t.cfg.seq_len)
