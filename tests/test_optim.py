"""fived.optim: the flat AdamW steps a shard exactly like the same elements of the whole and like
``torch.optim.AdamW``; the warm-up + cosine schedule; clipping by the global norm. And the
engines' ``full_grads()``: ZeRO-1/2/3 on 2 ranks give DDP's reduced gradients."""

from __future__ import annotations

import math

import pytest
import torch

from fived.config import ParallelConfig, preset
from fived.optim import FlatAdamW, accumulate_sq, clip_, clip_coef, lr_at
from fived.testing import run_ranks, small_train

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
SHAPES = [(5, 7), (11,), (3, 4)]
LRS = [1e-2, 3e-3, 5e-3]


def _data(steps: int = 3):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    return params, grads


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def test_flat_adamw_shard_equals_whole_and_torch():
    params, grads = _data()
    # torch.optim.AdamW on the original tensors
    ref = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(ref, lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    # fived: the whole flat tensor, and the same flat tensor in 3 shards stepped separately
    whole = _flat(params)
    n = whole.numel()
    bounds = [0, n // 3, 2 * n // 3, n]
    shards = [whole[a:b].clone() for a, b in zip(bounds, bounds[1:])]
    flat_opt = FlatAdamW([whole], *BETAS, EPS, WD)
    shard_opts = [FlatAdamW([s], *BETAS, EPS, WD) for s in shards]
    for lr, gs in zip(LRS, grads):
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        gflat = _flat(gs)
        flat_opt.step([gflat], lr)
        for o, a, b in zip(shard_opts, bounds, bounds[1:]):
            o.step([gflat[a:b]], lr)
    # a shard steps exactly like the same elements of the whole (elementwise arithmetic)
    assert torch.equal(torch.cat(shards), whole)
    for o, a, b in zip(shard_opts, bounds, bounds[1:]):
        assert torch.equal(o.m[0], flat_opt.m[0][a:b]) and torch.equal(o.v[0], flat_opt.v[0][a:b])
    # and like torch's AdamW
    assert (whole - _flat([p.detach() for p in ref])).abs().max() < 1e-6
    assert flat_opt.state_bytes() == 8 * n


def test_flat_adamw_state_dict_round_trip():
    params, grads = _data(steps=4)
    a = FlatAdamW([_flat(params)], *BETAS, EPS, WD)
    for gs in grads[:2]:
        a.step([_flat(gs)], 1e-2)
    b = FlatAdamW([a.params[0].clone()], *BETAS, EPS, WD)
    b.load_state_dict({k: v.clone() for k, v in a.state_dict().items()})
    assert b.t == 2
    for gs in grads[2:]:
        a.step([_flat(gs)], 1e-2)
        b.step([_flat(gs)], 1e-2)
    assert torch.equal(a.params[0], b.params[0])


def test_lr_schedule_warmup_and_cosine_endpoints():
    lr, steps, warmup, r = 1e-3, 100, 10, 0.1
    assert lr_at(0, steps, lr, warmup, r) == pytest.approx(lr / warmup)
    assert lr_at(warmup - 1, steps, lr, warmup, r) == pytest.approx(lr)
    assert lr_at(warmup, steps, lr, warmup, r) == pytest.approx(lr)  # cosine starts at the peak
    mid = warmup + (steps - warmup) // 2
    assert lr_at(mid, steps, lr, warmup, r) == pytest.approx(lr * (r + (1 - r) * 0.5))
    assert lr_at(steps, steps, lr, warmup, r) == pytest.approx(r * lr)
    assert lr_at(steps + 50, steps, lr, warmup, r) == pytest.approx(r * lr)  # stays at the floor
    decay = [lr_at(s, steps, lr, warmup, r) for s in range(warmup, steps + 1)]
    assert all(x >= y for x, y in zip(decay, decay[1:]))
    assert lr_at(7, 5, lr, 5, r) == lr  # no room to decay: the peak after warm-up


def test_clip_scales_to_the_max_norm():
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(s, generator=g) * 3 for s in SHAPES]
    want = math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))
    ref = [torch.zeros_like(t, requires_grad=True) for t in ts]  # torch clips p.grad
    for p, t in zip(ref, ts):
        p.grad = t.clone()
    norm = clip_(ts, 1.0)
    assert norm == pytest.approx(want, rel=1e-12)
    after = math.sqrt(sum(float(t.pow(2).sum()) for t in ts))
    assert after == pytest.approx(1.0, rel=1e-5)
    # torch's rule, same result
    torch_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0, foreach=False)
    assert float(torch_norm) == pytest.approx(norm, rel=1e-6)
    assert all(torch.allclose(a, p.grad, rtol=1e-6, atol=0) for a, p in zip(ts, ref))
    # under the max (or max_norm 0 = off) nothing changes
    before = [t.clone() for t in ts]
    assert clip_(ts, 10.0) == pytest.approx(after) and all(map(torch.equal, ts, before))
    assert clip_coef(5.0, 0.0) is None and clip_coef(0.5, 1.0) is None
    # the weighted sum: a piece held by 2 of tp=4 ranks (parts 2) counts 2/4 on each
    acc = accumulate_sq(torch.zeros((), dtype=torch.float64), [(torch.ones(4), 0.5)])
    assert float(acc) == 2.0


def test_norm_sum_is_the_zero_started_chunked_sum_bit_for_bit():
    """``accumulate_sq`` skips the zero start, the split of a piece of one chunk and the
    multiplication by a weight of 1: the same float64 bits as ``s = 0; s += dot(chunk)…;
    acc += s·w`` over pieces of every kind (empty, one chunk, several, w = 1 and not).
    Mutation: summing a piece's chunks in another order, or in float32, fails it."""
    from fived.optim.clip import SQ_CHUNK

    g = torch.Generator().manual_seed(5)
    pieces = [(torch.randn(n, generator=g) * 10.0 ** (k % 7 - 3), w) for k, (n, w) in enumerate(
        [(0, 1.0), (17, 1.0), (1000, 0.5), (SQ_CHUNK, 1.0), (SQ_CHUNK + 1, 0.25),
         (64, 1 / 3)])]
    # chunks whose Σg² are 1e16, 1, 1: in order 1e16 + 1 rounds to 1e16 twice, the other way
    # 1 + 1 + 1e16 is 1e16 + 2 (the chunks' order shows in the bits)
    order = torch.zeros(3 * SQ_CHUNK)
    order[0], order[SQ_CHUNK], order[2 * SQ_CHUNK] = 1e8, 1.0, 1.0
    pieces.append((order, 1.0))
    want = torch.zeros((), dtype=torch.float64)
    for t, w in pieces:
        s = torch.zeros((), dtype=torch.float64)
        for c in t.split(SQ_CHUNK):
            s += torch.dot(c.double(), c.double())
        want += s * w
    got = accumulate_sq(torch.zeros((), dtype=torch.float64), pieces)
    assert got.item() == want.item()


# ---------------------------------------------------------------- full_grads parity

MODEL = preset("tiny")
GRAD_CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "fp16")]


def _full_grads(rank: int, world: int) -> dict:
    from fived.train.trainer import Trainer

    out = {}
    for zero, precision in GRAD_CASES:
        par = ParallelConfig(dp=world, zero=zero, precision=precision, bucket_mb=0.05,
                             micro_batches=2)
        train = small_train(steps=1)
        t = Trainer(MODEL, par, train, rank, world)
        x, y, pos = t.local_data(0)
        tokens = train.global_batch * MODEL.seq_len
        t.engine.zero_grad()
        t.forward_backward(x, y, pos, 1.0 / tokens)
        t.engine.finish()
        model_traffic = {k: v for k, v in t.traffic.as_dict().items() if k != "metrics"}
        grads = t.engine.full_grads()
        after = {k: v for k, v in t.traffic.as_dict().items() if k != "metrics"}
        out[(zero, precision)] = {  # numpy: tensors would travel as shared memory
            "grads": {n: g.numpy() for n, g in grads.items()}, "traffic_unchanged": after == model_traffic,
            "metrics": t.traffic.as_dict().get("metrics", {}),
            "names": [n for n, p in t.stage.named_parameters()],
            "shapes": {n: tuple(p.shape) for n, p in t.stage.named_parameters()}}
    return out


def test_full_grads_zero_equal_ddp():
    ranks = run_ranks(_full_grads, 2)
    ddp = {n: torch.from_numpy(g) for n, g in ranks[0][(0, "fp32")]["grads"].items()}
    for r in ranks:
        for (zero, precision), res in r.items():
            grads = {n: torch.from_numpy(g) for n, g in res["grads"].items()}
            assert set(grads) == set(res["names"])
            for name, g in grads.items():
                assert tuple(g.shape) == res["shapes"][name] and g.dtype == torch.float32
                want = ddp[name]
                if precision == "fp32":
                    assert torch.allclose(g, want, rtol=1e-6, atol=1e-9), (zero, name)
                else:  # fp16 compute, fp32 reduction, unscaled: close to the fp32 gradient
                    err = float((g - want).norm() / want.norm())
                    assert err < 2e-2, (zero, precision, name, err)
            # the gathers are metrics-only: model traffic untouched (the ledger ignores them)
            assert res["traffic_unchanged"]
            assert ("all_gather" in res["metrics"]) == (zero > 0)
