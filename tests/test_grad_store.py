"""ZeRO-2/3's transient gradient buffer is allocated unfilled (``grads.ShardGrads``): each
parameter's first gradient is copied in, later micro-batches' added, the padding zeroed at once
and a parameter that got no gradient zeroed when its reduction starts. Here the fresh buffer is
filled with NaN (``ShardGrads.fresh``), as garbage memory could be: every reduced gradient must
still equal the sum of the ranks' autograd gradients, a parameter without one must be exactly 0,
and every owned shard (the padding included) and every updated parameter finite. Leaving the
unused parameter, the padding or the accumulation out fails it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fived.testing import run_ranks

CASES = [(2, 1), (2, 2), (3, 2)]  # (ZeRO stage, micro-batches)


class Toy(nn.Module):
    """33 parameters (odd: the 2-shard buckets pad), one of them never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(5, 3), nn.Linear(3, 2)
        self.unused = nn.Parameter(torch.randn(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def batch(rank: int, step: int, k: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + 10 * rank + k))


def _rank(rank: int, world: int) -> list[str]:
    from fived.comm.ops import Traffic
    from fived.config import ParallelConfig
    from fived.parallel.data import make_engine
    from fived.parallel.data.grads import ShardGrads
    from fived.ranks.grid import Grid
    from fived.testing import small_train

    ShardGrads.fresh = lambda self, n: torch.full((n,), float("nan"), dtype=self.grad_dtype)
    problems = []
    for zero, micro in CASES:
        par = ParallelConfig(dp=world, zero=zero, micro_batches=micro)
        model, ref = Toy(), Toy()
        grid = Grid.from_config(par, rank).connect(Traffic())
        engine = make_engine(model, grid, par, small_train(), None,
                             units=[model.a, model.b] if zero == 3 else None)
        for step in range(2):
            engine.zero_grad()
            ref.zero_grad()
            for k in range(micro):
                engine.set_last_micro(k == micro - 1)
                model(batch(rank, step, k)).square().sum().backward()
                for r in range(world):  # every rank's gradient, summed: the reduced one
                    ref(batch(r, step, k)).square().sum().backward()
            engine.finish()
            got = engine.full_grads()
            for name, p in ref.named_parameters():
                want = p.grad if p.grad is not None else torch.zeros_like(p)
                if name == "unused" and not torch.equal(got[name], want):
                    problems.append(f"zero{zero} m{micro} step {step}: unused {got[name]}")
                elif not torch.allclose(got[name], want, rtol=1e-5, atol=1e-6):
                    problems.append(f"zero{zero} m{micro} step {step}: {name} {got[name]} "
                                    f"!= {want}")
            if not all(torch.isfinite(b.grad_shard).all() for b in engine.buckets):
                problems.append(f"zero{zero} m{micro} step {step}: a shard is not finite")
            engine.clip(1e9)
            engine.step(1e-2)
            now = engine.full_params()  # ZeRO-3 frees whole parameters between uses
            with torch.no_grad():  # the reference follows the engine's parameters
                for name, q in ref.named_parameters():
                    q.copy_(now[name])
        if not all(torch.isfinite(b.param_shard).all() for b in engine.buckets):
            problems.append(f"zero{zero} m{micro}: a parameter shard is not finite")
        engine.close()
    return problems


@pytest.fixture(scope="module")
def runs() -> list[list[str]]:
    return run_ranks(_rank, 2, timeout=120)


def test_an_unfilled_gradient_buffer_reduces_as_a_zeroed_one(runs):
    for rank, problems in enumerate(runs):
        assert not problems, (rank, problems)
