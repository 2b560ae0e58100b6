"""Mutation tests of the dry run's ledger check: each breaks the runtime in one small way that
the old check (numel × element size, one traffic sum per group, a 2 % activation tolerance,
substitutes for the attention) let through, and asserts that ``verify.compare_record`` on the
dry run's record now reports it — and reports nothing for the unbroken runtime. Tiny models,
seconds each.

The MoE layer runs its own ``MoE.moe`` in the dry run; only ``MoE.assign`` (its routing is data:
``nonzero``, ``bincount``, ``tolist``) is made uniform there, and a CPU run at uniform routing
checks that the uniform assignment saves what the real one saves (each storage's dtype and
bytes) and gives the output's shape."""

from __future__ import annotations

import pytest

from fived.config import ParallelConfig, TrainConfig, preset

torch = pytest.importorskip("torch")

TRAIN = TrainConfig(global_batch=4)


def _bad(model: str, par: ParallelConfig, train: TrainConfig = TRAIN) -> list[str]:
    """Mismatches between the ledger and the dry run of every distinct rank of ``par``."""
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    m = preset(model)
    out = dry_run(m, par, train, distinct_ranks(par), show=False)
    return verify.compare_record(m, par, train.global_batch, out)


# ------------------------------------------------------------------------ model states
def test_a_state_over_allocated_behind_a_view_is_caught(monkeypatch):
    """ZeRO-1's full gradient buffer allocated twice its size, the engine holding a correctly
    sized view: ``engine.memory()`` (numel × element size) is unchanged, the storage is not."""
    from fived.parallel.data import base

    par = ParallelConfig(dp=2, zero=1)
    assert _bad("tiny", par) == []

    def doubled(self, b):
        b.grad = torch.zeros(2 * b.padded, dtype=self.policy.grad, device=self.device)[:b.padded]
        b.grad_shard = b.grad[b.lo:b.hi]

    monkeypatch.setattr(base.DataParallel, "build_grads", doubled)
    bad = _bad("tiny", par)
    assert bad and all("storage[grads]" in line for line in bad), bad


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_buffers_are_compared_with_the_ledger(monkeypatch, zero):
    """ZeRO-2/3's transient full-gradient bucket held twice (a leak in ``ensure_grad``'s
    accounting): the engine's ``buffers`` peak now differs from the ledger's zero_full_grads
    (+ zero3_gather)."""
    from fived.parallel.data import zero12

    par = ParallelConfig(dp=2, zero=zero)
    assert _bad("tiny", par) == []
    orig = zero12.Zero2.ensure_grad

    def held_twice(self, b):
        fresh = b.grad is None
        g = orig(self, b)
        if fresh:
            self.hold(g.numel() * g.element_size())
        return g

    monkeypatch.setattr(zero12.Zero2, "ensure_grad", held_twice)
    bad = _bad("tiny", par)
    assert bad and all("buffers" in line for line in bad), bad


# every case the ledger's replay (``memory.zero_buffer_peak``) must match to the byte: two
# reduction groups in flight at once (experts over ep), micro-batches, pp with one chunk
BUFFER_CASES = [
    ("tiny-moe", dict(dp=2, ep=2, zero=3), 4),
    ("tiny-moe", dict(dp=2, ep=2, zero=2), 4),
    ("tiny-moe", dict(dp=2, zero=3), 4),
    ("tiny-moe", dict(dp=2, ep=2, zero=3, micro_batches=2), 8),
    ("tiny-moe", dict(pp=2, dp=2, ep=2, zero=3, micro_batches=2, zero3_pp_gather="micro"), 8),
    ("tiny", dict(pp=2, dp=2, zero=3), 4),
    ("tiny", dict(pp=2, dp=2, zero=3, virtual_stages=2, schedule="interleaved",
                  micro_batches=2), 4),
]


@pytest.mark.parametrize("model,kw,gb", BUFFER_CASES)
def test_zero_buffers_exact_with_ep_and_pp(model, kw, gb):
    """The unbroken runtime's ``buffers`` peak equals the ledger's on every distinct rank
    (nothing skipped: the check runs)."""
    from fived.ledger import verify

    par = ParallelConfig(**kw)
    assert verify.buffers_check_skipped(preset(model), par) is None
    assert _bad(model, par, TrainConfig(global_batch=gb)) == []


def test_zero3_buffers_leak_with_experts_over_ep_is_caught(monkeypatch):
    """ZeRO-3 with experts over ep: an expert bucket's buffer held twice is caught."""
    from fived.parallel.data import zero12

    par = ParallelConfig(dp=2, ep=2, zero=3)
    orig = zero12.Zero2.ensure_grad

    def held_twice(self, b):
        fresh = b.grad is None
        g = orig(self, b)
        if fresh and b.group_name == "expert":
            self.hold(g.numel() * g.element_size())
        return g

    monkeypatch.setattr(zero12.Zero2, "ensure_grad", held_twice)
    bad = _bad("tiny-moe", par)
    assert bad and all("buffers" in line for line in bad), bad


def test_zero3_micro_gathers_with_several_chunks_stay_skipped():
    from fived.ledger import verify

    par = ParallelConfig(pp=2, dp=2, zero=3, virtual_stages=2, schedule="interleaved",
                         micro_batches=2, zero3_pp_gather="micro")
    assert "schedule" in verify.buffers_check_skipped(preset("tiny"), par)


# ------------------------------------------------------------------------ traffic
def test_an_extra_collective_of_another_op_is_caught(monkeypatch):
    """DDP's gradient all-reduce replaced, where the bucket divides, by a reduce-scatter and an
    all-gather on the same group: the same bytes per group (RS + AG = AR), so only the
    comparison per (group, op) sees it."""
    from fived.comm import ops
    from fived.parallel.data import ddp

    par = ParallelConfig(dp=2)
    assert _bad("tiny", par) == []
    split = []

    def rs_ag(self, b):
        t, n = b.grad, b.group.size
        if t.numel() % n:
            return ops.all_reduce(t, b.group, async_op=True)
        split.append(b)
        shard = ops.reduce_scatter(t, b.group)
        ops.all_gather_into(t, shard, b.group)
        return ops.Handle(None, b.group, "all_reduce")

    monkeypatch.setattr(ddp.DDP, "start_reduce", rs_ag)
    bad = _bad("tiny", par)
    assert split, "no bucket divides over dp: the mutation did nothing"
    assert bad and all("/" in line.split("traffic[")[1] for line in bad), bad
    assert not any("traffic[dense]" in line for line in bad)  # the group's total is unchanged


# ------------------------------------------------------------------------ activations
def _patch_first_block(monkeypatch, change) -> None:
    """Block 0's output goes through ``change(out)`` (the other blocks are left alone)."""
    from fived.model import llama

    orig_init, orig_forward = llama.Block.__init__, llama.Block.forward

    def init(self, cfg, index, dtype):
        orig_init(self, cfg, index, dtype)
        self.mutated = index == 0

    def forward(self, h, rope):
        out = orig_forward(self, h, rope)
        return change(out) if self.mutated else out

    monkeypatch.setattr(llama.Block, "__init__", init)
    monkeypatch.setattr(llama.Block, "forward", forward)


def test_an_activation_over_allocated_behind_a_view_is_caught(monkeypatch):
    """The first block's output written into the first half of a buffer twice its size: the
    next layer saves a correctly shaped view, the storage saved is twice as large."""
    par = ParallelConfig()
    assert _bad("tiny", par) == []

    def doubled(out):
        buf = torch.empty((2,) + tuple(out.shape), dtype=out.dtype, device=out.device)[0]
        return buf.copy_(out)

    _patch_first_block(monkeypatch, doubled)
    bad = _bad("tiny", par)
    assert bad and all("activation peak" in line for line in bad), bad


def test_a_stray_saved_tensor_of_one_percent_is_caught(monkeypatch):
    """The first block saves one stray tensor of 1 % of the ledger's activation peak (the old
    2 % tolerance let it through)."""
    from fived.ledger import verify

    par = ParallelConfig()
    m = preset("tiny")
    assert _bad("tiny", par) == []
    stray_bytes = int(0.01 * verify.predict_activations(m, par, TRAIN.global_batch, 0))

    def stray(out):
        extra = torch.zeros(stray_bytes // 4, device=out.device)  # fp32: 4 bytes each
        return out + (extra * out.reshape(-1)[:1]).sum()  # mul saves the stray

    _patch_first_block(monkeypatch, stray)
    bad = _bad("tiny", par)
    assert bad and all("activation peak" in line for line in bad), bad


def test_a_bug_inside_causal_attention_is_caught(monkeypatch):
    """``layers.causal_attention`` with an extra saved tensor (its output multiplied by a mask of
    ones): the dry run runs the runtime's own attention, so the saved bytes grow. (The old dry
    run replaced the function and never ran it.)"""
    from fived.model import layers

    par = ParallelConfig()
    assert _bad("tiny", par) == []
    orig = layers.causal_attention

    def masked(q, k, v):
        o = orig(q, k, v)
        return o * torch.ones_like(o)  # mul saves the mask for o's gradient

    monkeypatch.setattr(layers, "causal_attention", masked)
    bad = _bad("tiny", par)
    assert bad and all("activation peak" in line for line in bad), bad


# ------------------------------------------------------------------------ MoE
def _uniform_case():
    """A tiny-moe MoE layer on the CPU and an input routed uniformly: token t's top-k experts
    are t·k .. t·k+k-1 (mod E), so every expert gets tokens·k/E rows and none is dropped."""
    from fived.model.moe import MoE

    cfg = preset("tiny-moe")
    E, k = cfg.experts, cfg.top_k
    torch.manual_seed(0)
    layer = MoE(cfg, 0)
    b, s = 2, 8
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[:, :E] = 4 * torch.eye(E)
        x = 0.1 * torch.randn(b * s, cfg.hidden)
        x[:, :E] = 0
        for t in range(b * s):
            for j in range(k):
                x[t, (t * k + j) % E] = 1.0 - 0.1 * j
    return layer, x.view(b, s, cfg.hidden).requires_grad_()


def _saved_and_out(layer, x, moe):
    from fived.train.activations import SavedTensors

    with SavedTensors(exclude=list(layer.parameters())) as saved:
        out = moe(layer, x)
    return (saved.bytes, sorted(saved.sizes)), out


def test_the_uniform_assignment_saves_what_routing_saves():
    from fived.model.moe import MoE
    from fived.train.dryrun import _uniform_assign

    layer, x = _uniform_case()
    real, out_real = _saved_and_out(layer, x, MoE.moe)
    assert layer.stats.dropped == 0 and layer.stats.tokens_per_expert.tolist() == [8.0] * 4
    layer.assign = _uniform_assign.__get__(layer)
    twin, out_twin = _saved_and_out(layer, x, MoE.moe)
    # the uniform rows are in assignment order, not the router's (values differ): shapes are
    # what the dry run measures
    assert out_twin.shape == out_real.shape and out_twin.dtype == out_real.dtype
    assert twin == real  # total bytes, and every storage's (dtype, bytes)


def test_a_bug_inside_moe_moe_is_caught(monkeypatch):
    """``MoE.moe`` saving one extra tensor (its input multiplied by a mask of ones): the dry
    run, which runs ``MoE.moe`` itself, reports the activation peak."""
    from fived.model.moe import MoE

    par = ParallelConfig()
    assert _bad("tiny-moe", par) == []
    orig = MoE.moe

    def masked(self, x):
        return orig(self, x * torch.ones_like(x))

    monkeypatch.setattr(MoE, "moe", masked)
    bad = _bad("tiny-moe", par)
    assert bad and all("activation peak" in line for line in bad), bad


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_saved_tensors_counts_storages_once(device):
    """``SavedTensors`` counts a saved view's whole storage, once however many views of it are
    saved, on the CPU and on meta (where every data pointer is 0)."""
    from fived.train.activations import SavedTensors

    w = torch.ones(4, device=device, requires_grad=True)
    big = torch.zeros(2, 4, device=device)  # 32 bytes behind each 16-byte row
    other = torch.zeros(4, device=device)
    with SavedTensors() as saved:
        y = (w * big[0]) + (w * big[1]) + (w * other)  # mul saves each plain operand
    assert saved.count == 2 and saved.bytes == 32 + 16
    assert y.shape == (4,)
