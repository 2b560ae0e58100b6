"""Grouped expert matmuls (issue 29, ``fived.model.grouped``, ``expert_matmul``).

* the grouped function equals the loop of ``Expert`` modules: outputs, the rows' gradient and
  every expert weight's gradient to 1e-6 in fp32 (random counts with empty experts, all rows
  to one expert, no rows at all; the ``torch._grouped_mm`` kernel and the per-expert
  fallback), and within bf16 rounding in bf16;
* what it saves for backward is, byte for byte, what the loop saves (the ledger's terms), the
  stack it makes is the ledger's ``expert_stack``, and the gradients reach the parameters in
  the loop's order (last registered first: the engines' bucket order);
* parity: ``expert_matmul = "grouped"`` at ep2 (also with full recompute) and at ep2·dp2 with
  ZeRO-3 equals the one-rank run with the loop (one spawn per world size);
* the dry run in grouped mode (fp32: the fallback on fake tensors; bf16: the kernel's meta
  function) matches the ledger;
* mutations: an offset shifted by one row, or one expert's weight gradient dropped, is caught.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ParallelConfig, TrainConfig, preset
from fived.model import grouped as grouped_gemm
from fived.model.moe import Expert

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_moe_parity, one_rank, train_runs  # noqa: E402,I001

H, F = 16, 24
COUNTS = {
    "random": None,  # drawn below, with empty experts
    "empty-experts": [3, 0, 5, 0, 0, 2],
    "all-to-one": [0, 0, 11, 0],
    "no-rows": [0, 0, 0],
    "one-expert": [7],
}


def _counts(name: str) -> list[int]:
    if COUNTS[name] is not None:
        return COUNTS[name]
    g = torch.Generator().manual_seed(5)
    c = torch.randint(0, 9, (16,), generator=g)
    c[torch.randperm(16, generator=g)[:4]] = 0
    return c.tolist()


def _experts(n: int, dtype: torch.dtype, seed: int = 0) -> list[Expert]:
    torch.manual_seed(seed)
    return [Expert(H, F, dtype) for _ in range(n)]


def _run(experts, counts, dtype, grouped: bool, kernel=None, seed: int = 1):
    """(output, d rows, [every weight's grad]) of one forward and backward."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), H, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(sum(counts), H, generator=g).to(dtype)
    for ex in experts:
        for p in ex.parameters():
            p.grad = None
    if grouped:
        y = grouped_gemm.grouped_experts(x, counts, experts, kernel)
    else:
        y = torch.cat([ex(c) for ex, c in zip(experts, torch.split(x, counts))])
    y.backward(dy)
    return y.detach(), x.grad, [p.grad for ex in experts for p in ex.parameters()]


def _close(a, b, atol, rtol=0.0) -> None:
    ya, xa, wa = a
    yb, xb, wb = b
    torch.testing.assert_close(ya, yb, atol=atol, rtol=rtol)
    torch.testing.assert_close(xa, xb, atol=atol, rtol=rtol)
    assert len(wa) == len(wb) and all(w is not None for w in wa)
    for i, (u, v) in enumerate(zip(wa, wb)):
        torch.testing.assert_close(u, v, atol=atol, rtol=rtol, msg=f"weight {i}")


@pytest.mark.parametrize("kernel", [True, False], ids=["grouped_mm", "fallback"])
@pytest.mark.parametrize("name", list(COUNTS))
def test_grouped_equals_the_loop_fp32(name, kernel):
    counts = _counts(name)
    ex = _experts(len(counts), torch.float32)
    ref = _run(ex, counts, torch.float32, grouped=False)
    got = _run(ex, counts, torch.float32, grouped=True, kernel=kernel)
    _close(got, ref, atol=1e-6)
    for e, n in enumerate(counts):  # an expert with no rows gets a zero gradient, not None
        if n == 0:
            assert all(float(w.abs().max()) == 0 for w in got[2][3 * e:3 * e + 3])


@pytest.mark.parametrize("name", ["random", "all-to-one", "no-rows"])
def test_grouped_equals_the_loop_bf16(name):
    """bf16 in and out on both sides (fp32 accumulation inside each matmul): within a few bf16
    ulps of the loop, relative to each tensor's scale."""
    counts = _counts(name)
    ex = _experts(len(counts), torch.bfloat16)
    ref = _run(ex, counts, torch.bfloat16, grouped=False)
    got = _run(ex, counts, torch.bfloat16, grouped=True)
    _close(got, ref, atol=2e-2, rtol=2e-2)


def test_the_ledgers_bytes_and_the_gradient_order():
    """Saved bytes equal the loop's (storage by storage: X once, G, U, P), the forward's and the
    backward's stacks are each ``expert_stack_bytes`` of the ledger, and every parameter gets
    its gradient in the loop's order."""
    from fived.ledger.memory import expert_stack_bytes
    from fived.train.activations import SavedTensors

    counts = _counts("random")
    ex = _experts(len(counts), torch.float32)
    params = [p for e in ex for p in e.parameters()]
    seen = {}
    for grouped in (False, True):
        order: list[int] = []
        hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i, o=order: o.append(i))
                 for i, p in enumerate(params)]
        x = torch.randn(sum(counts), H, requires_grad=True)
        rows = x * 1.0  # a non-leaf, as the routed rows are
        with SavedTensors(exclude=params) as s:  # as the trainer: weights are no activations
            y = (grouped_gemm.grouped_experts(rows, counts, ex) if grouped else
                 torch.cat([e(c) for e, c in zip(ex, torch.split(rows, counts))]))
        y.sum().backward()
        for h in hooks:
            h.remove()
        seen[grouped] = (s.bytes, order)
    assert seen[True] == seen[False]
    n = sum(counts)
    assert seen[True][0] == 4 * (n * H + 3 * n * F)
    assert seen[True][1] == list(range(len(params)))[::-1]

    stacks: list[int] = []
    real = grouped_gemm._stacks
    grouped_gemm._stacks = lambda w, E: [stacks.append(t.numel() * t.element_size()) or t
                              for t in real(w, E)]
    try:
        grouped_gemm.grouped_experts(torch.randn(sum(counts), H, requires_grad=True), counts, ex
                          ).sum().backward()
    finally:
        grouped_gemm._stacks = real
    m = replace(preset("tiny-moe"), hidden=H, moe_ffn=F, experts=2 * len(counts))
    per = expert_stack_bytes(m, ParallelConfig(ep=2))
    assert len(stacks) == 6 and sum(stacks[:3]) == sum(stacks[3:]) == per


def test_which_path_each_mode_takes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.zeros(4, 64)
    assert grouped_gemm.use_grouped("grouped", x, 64, 32) and not grouped_gemm.use_grouped("loop", x, 64, 32)
    assert grouped_gemm.use_grouped("auto", x, 64, 32)  # fp32 on the CPU: the kernel runs
    assert not grouped_gemm.use_grouped("auto", x, 6, 32)  # 24-byte rows: not 16-byte aligned
    assert not grouped_gemm.use_grouped("auto", x.double(), 64, 32)  # no float64 kernel
    assert not grouped_gemm.use_grouped("auto", x.bfloat16(), 64, 4)  # 8-byte rows in bf16
    with FakeTensorMode():  # the op's meta function takes bf16 only
        f = torch.zeros(4, 64, device="meta")
        assert not grouped_gemm.grouped_supported(f, 64, 32)
        assert grouped_gemm.grouped_supported(f.bfloat16(), 64, 32)


# ------------------------------------------------------------------------ mutations

def test_a_shifted_offset_is_caught(monkeypatch):
    """An off-by-one group boundary (the last row of expert 0 given to expert 1) fails the
    comparison with the loop: the check above can fail."""
    counts = _counts("empty-experts")
    ex = _experts(len(counts), torch.float32)
    ref = _run(ex, counts, torch.float32, grouped=False)
    real = grouped_gemm._offsets

    def shifted(c, like):
        o = real(c, like)
        o[0] -= 1
        return o

    monkeypatch.setattr(grouped_gemm, "_offsets", shifted)
    with pytest.raises(AssertionError):
        _close(_run(ex, counts, torch.float32, grouped=True, kernel=True), ref, atol=1e-6)


def test_a_dropped_weight_gradient_is_caught(monkeypatch):
    """Expert 2's w3 gradient returned as zeros: the comparison with the loop fails."""
    counts = _counts("empty-experts")
    ex = _experts(len(counts), torch.float32)
    ref = _run(ex, counts, torch.float32, grouped=False)
    real = grouped_gemm.GroupedSwiGLU.backward
    E = len(counts)

    def dropped(ctx, dy):
        out = list(real(ctx, dy))
        out[4 + E + 2] = torch.zeros_like(out[4 + E + 2])
        return tuple(out)

    monkeypatch.setattr(grouped_gemm.GroupedSwiGLU, "backward", staticmethod(dropped))
    with pytest.raises(AssertionError, match="weight 7"):
        _close(_run(ex, counts, torch.float32, grouped=True), ref, atol=1e-6)


# ------------------------------------------------------------------------ parity

MODEL = preset("qwen3-moe-tiny")  # 8 experts, top-4, h 64, expert ffn 32
GROUPED = replace(MODEL, expert_matmul="grouped")


def test_grouped_parity_ep2_and_recompute():
    ref = one_rank(replace(MODEL, expert_matmul="loop"), _train())
    layouts = [ParallelConfig(ep=2), ParallelConfig(ep=2, recompute="full")]
    for p, out in zip(layouts, train_runs([(GROUPED, p, _train()) for p in layouts])):
        check_moe_parity(out, ref, p.describe())


def test_grouped_parity_ep2_dp2_zero3():
    ref = one_rank(replace(MODEL, expert_matmul="loop"), _train())
    p = ParallelConfig(ep=2, dp=2, zero=3)
    check_moe_parity(train_runs([(GROUPED, p, _train())])[0], ref, p.describe())


def _train() -> TrainConfig:
    from fived.testing import small_train

    return small_train()


# ------------------------------------------------------------------------ the dry run

@pytest.mark.parametrize("par", [
    ParallelConfig(ep=2, dp=2, zero=3),
    ParallelConfig(ep=2, dp=2, zero=2, precision="bf16"),
    ParallelConfig(ep=2, pp=2, micro_batches=2, recompute="full", precision="bf16"),
], ids=["fp32-zero3", "bf16-zero2", "bf16-pp2-recompute"])
def test_grouped_dry_run_matches_the_ledger(tmp_path, par):
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    m = replace(preset("tiny-moe"), expert_matmul="grouped")
    train = TrainConfig(global_batch=8)
    out = dry_run(m, par, train, distinct_ranks(par), out_path=str(tmp_path / "d.jsonl"),
                  show=False)
    assert verify.compare_record(m, par, train.global_batch, out) == []
