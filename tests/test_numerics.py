"""bf16 parameters without the fp32 master (``--master-weights none|sr|kahan``): the rounding
primitives, the loss tracking the fp32-master run, and the ledger's master bytes (4Ψ -> 0 / 2Ψ)
equal to what the engine holds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.ledger.verify import compare_record
from fived.parallel.precision import stochastic_round_bf16, write_back
from fived.testing import small_train

SMALL = replace(preset("tiny"), layers=2, hidden=32, ffn=88, seq_len=32)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way from 1 to the next bf16
    gen = torch.Generator().manual_seed(0)
    r = stochastic_round_bf16(x, gen).float()
    lo, hi = 1.0, 1.0 + 2**-7
    assert set(r.unique().tolist()) <= {lo, hi}
    assert abs(float(r.mean()) - float(x[0])) < 2e-5  # E[round(x)] = x
    assert abs(float((r == hi).float().mean()) - 0.125) < 0.005  # (x − lo) / ulp


def test_kahan_write_back_keeps_updates_round_to_nearest_loses():
    """10 000 updates of 1e-4 to a weight of 1.0 (half a bf16 ulp is 2⁻⁸ ≈ 3.9e-3): round to
    nearest loses every one, the compensated bf16 pair keeps their sum (to 2.6 %: c is bf16
    too, so each step rounds c at ~2⁻⁹·|c| — the pair carries about 16 bits, not 24)."""
    p_none = torch.ones(1, dtype=torch.bfloat16)
    p_k, comp = torch.ones(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
    lost = 0
    for _ in range(10_000):
        lost += int(write_back(p_none, p_none.float() + 1e-4, "none").sum())
        write_back(p_k, p_k.float() + comp.float() + 1e-4, "kahan", comp)
    assert float(p_none) == 1.0 and lost == 10_000
    assert abs(float(p_k) + float(comp) - 2.0) < 0.05


def test_master_weights_needs_bf16():
    with pytest.raises(ConfigError, match="master-weights"):
        validate(SMALL, ParallelConfig(master_weights="sr"), small_train())
    validate(SMALL, ParallelConfig(precision="bf16", master_weights="kahan"), small_train())


def _run(master: str, steps: int = 8):
    from fived.train.trainer import Trainer

    par = ParallelConfig(precision="bf16", master_weights=master)
    t = small_train(steps=steps, lr=1e-3, warmup=2)
    tr = Trainer(SMALL, par, t, 0, 1)
    tr.engine.measure_rounding = True
    losses, lost = [], []
    for s in range(steps):
        losses.append(tr.step(s)["loss"])
        lost.append(tr.engine.rounding["lost"] / max(1, tr.engine.rounding["moved"]))
    mem = {k: int(v) for k, v in tr.engine.memory().items()}
    bad = compare_record(SMALL, par, t.global_batch, {"memory_per_rank": [mem],
                                                      "traffic_per_rank": [{"bytes": {}}]})
    return losses, lost, mem, bad


def test_master_weights_track_fp32_and_ledger_counts_master_bytes():
    ref, lost_ref, mem_ref, bad = _run("fp32")
    assert not bad
    n = mem_ref["params"] // 2  # bf16 parameters
    assert mem_ref["master"] == 4 * n
    for mode, master_bytes in (("none", 0), ("sr", 0), ("kahan", 2 * n)):
        losses, lost, mem, bad = _run(mode)
        assert not bad, (mode, bad)
        assert mem["master"] == master_bytes, mode
        gap = max(abs(a - b) for a, b in zip(losses, ref))
        if mode != "none":
            assert gap < 0.01, (mode, gap, losses, ref)
        if mode == "none":
            assert max(lost) > 0.01, lost  # updates lost to rounding, measured
        if mode == "kahan":
            assert max(lost) < 1e-3, lost
