"""The GPU path's pieces that run on the CPU too: every tensor on the rank's device, the fused
AdamW kernel equal to fived's own loop, and the device a rank picks. (The dry run on the meta
device, ``tests/test_dryrun.py``, is the test that nothing is left on the CPU.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_fused_adamw_equals_the_flat_loop():
    from fived.optim.adamw import FlatAdamW

    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(1000, generator=g), torch.randn(37, generator=g)]
    a = [p.clone() for p in ps]
    b = [p.clone() for p in ps]
    oa = FlatAdamW(a, 0.9, 0.95, 1e-8, 0.1, fused=False)
    ob = FlatAdamW(b, 0.9, 0.95, 1e-8, 0.1, fused=True)  # torch._fused_adamw_, on the CPU here
    for step in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in ps]
        oa.step(grads, 1e-2 * (step + 1))
        ob.step(grads, 1e-2 * (step + 1))
    for x, y in zip(a + oa.m + oa.v, b + ob.m + ob.v):
        assert torch.allclose(x, y, rtol=1e-6, atol=1e-7)
    assert ob.state_bytes() == oa.state_bytes()


def test_rank_device_is_cpu_without_nccl():
    from fived.ranks.launch import rank_device

    assert rank_device() == torch.device("cpu")


def test_model_built_on_the_given_device():
    from fived.config import preset
    from fived.model import build_model

    m = build_model(preset("tiny"), 1, device="meta", init=False)
    assert {p.device.type for p in m.parameters()} == {"meta"}
    ref = build_model(preset("tiny"), 1)
    assert {p.device.type for p in ref.parameters()} == {"cpu"}


@pytest.mark.slow
def test_compile_each_block_trains_the_same():
    """``--compile`` (torch.compile of every block; inductor on the CPU here): the same losses
    as eager on one rank, 2 steps (about 1.5 minutes on 2 cores, compile time)."""
    from dataclasses import replace

    from fived.config import ParallelConfig, preset
    from fived.testing import rel_diff, small_train
    from fived.train.trainer import train_rank

    train = small_train(steps=2, global_batch=4)
    eager = train_rank(0, 1, preset("tiny"), ParallelConfig(), train, show=False)["losses"]
    compiled = train_rank(0, 1, preset("tiny"), ParallelConfig(), replace(train, compile=True),
                          show=False)["losses"]
    assert rel_diff(compiled, eager) < 1e-5
