"""Context parallelism: zigzag sharding, ring attention and Ulysses against the one-rank model.

* the attention core alone (random q/k/v, outputs and grads against ``causal_attention`` on the
  gathered sequence), its bytes on the wire (exact), its saved activations (exact formula, 1/cp)
  and its per-rank FLOPs (zigzag balanced, contiguous not) — one spawn per cp degree;
* whole-model parity, cp ∈ {2, 4} × {ring, ulysses}, alone and with dp=2 / tp=2, on tiny and on
  a sequence 8× longer — losses over 5 steps and every parameter's gathered first-step gradient
  within 1e-5 relative, cp traffic per step exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.parallel import context
from fived.testing import run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, one_rank, train_runs  # noqa: E402

MODEL = preset("tiny")
LONG = dataclasses.replace(MODEL, seq_len=512)  # 8× the tiny default



# ------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("n", [1, 2, 4])
def test_zigzag_positions_partition_the_sequence(n):
    s = 64
    shards = [context.shard_positions(s, n, r) for r in range(n)]
    assert torch.equal(torch.sort(torch.cat(shards)).values, torch.arange(s))
    c = s // (2 * n)
    for r, p in enumerate(shards):  # head chunk r and tail chunk 2n−1−r
        assert p[0].item() == r * c and p[-1].item() == (2 * n - r) * c - 1


def test_ulysses_head_constraint_is_a_config_error():
    with pytest.raises(ConfigError, match="ulysses"):
        validate(MODEL, ParallelConfig(cp=8, cp_mode="ulysses"), None, 8)  # 4 heads, cp 8
    with pytest.raises(ConfigError, match="ulysses"):
        validate(MODEL, ParallelConfig(tp=2, cp=4, cp_mode="ulysses"), None, 8)  # 2 local heads
    with pytest.raises(ConfigError, match="not divisible by cp=4"):
        context.check_ulysses(2, 1, 4)
    validate(MODEL, ParallelConfig(cp=4, cp_mode="ulysses"), None, 4)  # 4 heads, kv replicated


# ------------------------------------------------------------------------------ the core alone
def _core_rank(rank: int, world: int, b: int, s: int, h: int, g: int, d: int) -> dict:
    import torch.distributed as dist

    from fived.comm.ops import Traffic
    from fived.model import layers
    from fived.ranks.grid import DimGroup
    from fived.train.activations import SavedTensors

    traffic = Traffic()
    group = DimGroup("cp", tuple(range(world)), rank, dist.group.WORLD, traffic)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, x, d, generator=gen) for x in (h, g, g))
    do = torch.randn(b, s, h, d, generator=gen)
    for t in (q, k, v):
        t.requires_grad_(True)
    layers.causal_attention(q, k, v).backward(do)
    ref_o = layers.causal_attention(q, k, v).detach()
    out: dict = {"err": {}, "bytes": {}, "act": {}, "flops": {}}
    for mode, layout, fused in (("ring", "zigzag", True), ("ring", "contiguous", True),
                                ("ring", "zigzag", False), ("ulysses", "zigzag", True),
                                ("allgather", "zigzag", True)):
        pos = context.shard_positions(s, world, rank, layout)
        ql, kl, vl = (t.detach()[:, pos].clone().requires_grad_(True) for t in (q, k, v))
        traffic.reset()
        stats = context.AttentionStats()
        # fused False: the explicit block math (any device and dtype); ring only
        kw = {"stats": stats, "fused": fused} if mode == "ring" else {}
        with SavedTensors() as saved:
            o = context.MODES[mode](ql, kl, vl, group, layout, **kw)
        fwd_flops, fwd_pairs = stats.flops, stats.pairs
        fwd_bytes = sum(r.bytes for r in traffic.records.values())
        o.backward(do[:, pos])
        if mode == "ring":  # the backward (through autograd) counts into the same object
            assert fwd_pairs > 0 and stats.pairs == 3 * fwd_pairs, (stats.pairs, fwd_pairs)
        tot = sum(r.bytes for r in traffic.records.values())
        key = f"{mode}/{layout}" + ("" if fused else "/explicit")
        out["err"][key] = max(
            ((o - ref_o[:, pos]).abs().max() / ref_o.abs().max()).item(),
            *(((a.grad - full.grad[:, pos]).abs().max() / full.grad.abs().max()).item()
              for a, full in ((ql, q), (kl, k), (vl, v))),
        )
        out["bytes"][key] = {"forward": fwd_bytes, "backward": tot - fwd_bytes}
        out["act"][key] = saved.bytes
        out["flops"][key] = fwd_flops
    if h == MODEL.heads:  # the whole tiny model at cp = world: activation bytes per rank
        out["model_act"] = _model_activation_bytes(rank, world, ParallelConfig(cp=world))
    return out


def _model_activation_bytes(rank: int, world: int, par: ParallelConfig) -> int:
    from fived.train.activations import SavedTensors
    from fived.train.trainer import Trainer

    trainer = Trainer(MODEL, par, small_train(), rank, world)
    x, y, positions = trainer.local_data(0)
    with SavedTensors(exclude=list(trainer.stage.parameters())) as saved:  # not weight views
        trainer.stage(x, positions, y)
    return saved.bytes


@pytest.fixture(scope="module", params=[(2, 4, 2), (4, 4, 2), (2, 2, 1)],
                ids=["cp2", "cp4", "cp2-tp2-local-heads"])
def core(request):
    n, h, g = request.param  # (2, 2, 1): the heads one rank of tp=2 holds (kv replicated)
    shape = {"b": 2, "s": 64, "h": h, "g": g, "d": 16}
    return n, shape, run_ranks(_core_rank, n, *shape.values())


def test_core_matches_causal_attention(core):
    n, _, ranks = core
    for r in ranks:
        for key, err in r["err"].items():
            assert err < 1e-5, (n, key, err)


def test_core_traffic_is_the_formula_exactly(core):
    n, sh, ranks = core
    args = (sh["b"], sh["s"] // n, sh["h"], sh["g"], sh["d"], n)
    for mode in ("ring", "ulysses", "allgather"):
        want = context.traffic_per_layer(mode, *args)
        if mode == "ulysses" and sh["g"] < n:  # kv heads replicated to cp before the all-to-all
            assert context.ulysses_kv_heads(sh["h"], sh["g"], n) == n
        for r in ranks:
            assert r["bytes"][f"{mode}/zigzag"] == want, (mode, r["bytes"], want)
    # ring: cp−1 K/V blocks forward; K/V and dK/dV (cp−1 each) backward
    kv = 2 * sh["b"] * (sh["s"] // n) * sh["g"] * sh["d"] * 4
    assert context.traffic_per_layer("ring", *args) == {"forward": (n - 1) * kv,
                                                  "backward": 2 * (n - 1) * kv}


def test_core_activation_bytes_fall_as_one_over_cp(core):
    n, sh, ranks = core
    want = context.activation_bytes("ring", sh["b"], sh["s"] // n, sh["h"], sh["g"], sh["d"], n)
    one = context.activation_bytes("ring", sh["b"], sh["s"], sh["h"], sh["g"], sh["d"], 1)
    assert want * n == one
    for r in ranks:
        got = r["act"]["ring/zigzag"]
        assert abs(got - want) <= 0.02 * want, (got, want)
        assert got == want


def test_model_activation_bytes_fall_as_one_over_cp(core):
    """Whole tiny model, one forward of the step-0 batch: every saved tensor is per local token,
    so bytes(cp) = (bytes(1) − L·core_sdpa(1))/cp + L·core_ring(cp), within 2% (exact here)."""
    n, sh, ranks = core
    if sh["h"] != MODEL.heads:
        pytest.skip("model measured on the tiny shapes only")
    from fived.model import layers
    from fived.train.activations import SavedTensors

    one = _model_activation_bytes(0, 1, ParallelConfig())
    b, s, h, g, d = small_train().global_batch, MODEL.seq_len, MODEL.heads, MODEL.kv_heads, 16
    q, k, v = (torch.randn(b, s, x, d, requires_grad=True) for x in (h, g, g))
    with SavedTensors() as saved:
        layers.causal_attention(q, k, v)
    rest = one - MODEL.layers * saved.bytes
    want = rest / n + MODEL.layers * context.activation_bytes("ring", b, s // n, h, g, d, n)
    for r in ranks:
        assert abs(r["model_act"] - want) <= 0.02 * want, (r["model_act"], want, one)
        assert r["model_act"] < one / n * 1.02


def test_zigzag_balances_attention_flops(core):
    n, sh, ranks = core
    zig = [r["flops"]["ring/zigzag"] for r in ranks]
    con = [r["flops"]["ring/contiguous"] for r in ranks]
    assert zig == context.attention_flops(sh["b"], sh["s"], sh["h"], sh["d"], n, "zigzag")
    assert con == context.attention_flops(sh["b"], sh["s"], sh["h"], sh["d"], n, "contiguous")
    assert max(zig) / min(zig) <= 1.05
    assert max(con) / min(con) >= 2.0  # contiguous: rank cp−1 does (4cp−1)/3 × rank 0's work
    assert sum(zig) == sum(con)


def test_ring_saves_only_local_tensors_on_one_rank():
    """cp=1 through the ring kernel: the formula at n=1 (the 1/cp baseline)."""
    from fived.ranks.grid import DimGroup
    from fived.train.activations import SavedTensors

    b, s, h, g, d = 2, 64, 4, 2, 16
    q, k, v = (torch.randn(b, s, x, d, requires_grad=True) for x in (h, g, g))
    with SavedTensors() as saved:
        o = context.RingAttention.apply(q, k, v, DimGroup("cp", (0,), 0), "zigzag", None, True)
    assert saved.bytes == context.activation_bytes("ring", b, s, h, g, d, 1)
    from fived.model import layers

    assert torch.allclose(o, layers.causal_attention(q, k, v), atol=1e-6)


# ------------------------------------------------------------------------------ whole model
@pytest.fixture(scope="module")
def reference():
    return one_rank(MODEL, small_train())


@pytest.fixture(scope="module")
def reference_long():
    return one_rank(LONG, small_train(global_batch=2))


def _check_cp_traffic(out, model, par, train):
    b = train.global_batch // (par.dp * par.ep)
    hl, gl = model.heads // par.tp, max(1, model.kv_heads // par.tp)
    per = context.traffic_per_layer(par.cp_mode, b, model.seq_len // par.cp, hl, gl, model.head_dim,
                              par.cp)
    want = model.layers * (per["forward"] + per["backward"])
    for rank_summary in out["ranks"]:
        for rank_traffic in rank_summary["history"][-1]["traffic_per_rank"]:
            assert rank_traffic["bytes"].get("cp", 0.0) == want


def _train(model, par, train):
    """Every rank's summary and the gathered first-step gradients (``parity_helpers``)."""
    return train_runs([(model, par, train)])[0]


def _parity(reference, model, par, train):
    out = _train(model, par, train)
    check_parity(out, reference, par)  # every rank's losses, every parameter's gradient
    assert reference["losses"][-1] < reference["losses"][0]
    _check_cp_traffic(out, model, par, train)
    return out


@pytest.mark.parametrize("cp,mode", [(2, "ring"), (4, "ring"), (2, "ulysses"),
                                     pytest.param(4, "ulysses", marks=pytest.mark.slow)])
def test_cp_matches_one_rank(reference, cp, mode):
    _parity(reference, MODEL, ParallelConfig(cp=cp, cp_mode=mode), small_train())


@pytest.mark.parametrize("mode", ["ring", pytest.param("ulysses", marks=pytest.mark.slow)])
def test_cp_with_dp_matches_one_rank(reference, mode):
    _parity(reference, MODEL, ParallelConfig(cp=2, dp=2, cp_mode=mode), small_train())


@pytest.mark.parametrize("cp,mode", [(4, "ring"), pytest.param(4, "ulysses", marks=pytest.mark.slow),
                                     pytest.param(2, "ring", marks=pytest.mark.slow)])
def test_long_sequence_matches_one_rank(reference_long, cp, mode):
    _parity(reference_long, LONG, ParallelConfig(cp=cp, cp_mode=mode), small_train(global_batch=2))


@pytest.mark.parametrize("mode", ["ring", pytest.param("ulysses", marks=pytest.mark.slow)])
def test_cp_with_tp_matches_one_rank(reference, mode):
    _parity(reference, MODEL, ParallelConfig(cp=2, tp=2, cp_mode=mode), small_train())


@pytest.mark.slow
@pytest.mark.parametrize("cp,extra", [(4, {"dp": 2}), (2, {"dp": 2, "zero": 1}),
                                      (2, {"micro_batches": 2}), (2, {"recompute": "selective"}),
                                      (2, {"recompute": "full"})])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp_matrix(reference, cp, extra, mode):
    par = ParallelConfig(cp=cp, cp_mode=mode, **extra)
    out = _train(MODEL, par, small_train())
    check_parity(out, reference, par)
    if extra.get("recompute") is None:
        _check_cp_traffic(out, MODEL, par, small_train())


@pytest.mark.slow
def test_cp4_with_tp2_matches_one_rank(reference):
    """Ring only: Ulysses with 2 local heads over cp 4 is a ConfigError (tested above)."""
    _parity(reference, MODEL, ParallelConfig(cp=4, tp=2), small_train())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp_with_pp_matches_one_rank(reference, mode):
    par = ParallelConfig(cp=2, pp=2, micro_batches=2, cp_mode=mode)
    check_parity(_train(MODEL, par, small_train()), reference, par)


def test_cost_module_is_torch_free():
    """The ledger may import the CP formulas for clusters that are not here."""
    import ast
    import pathlib

    import fived.ledger.context as cost

    tree = ast.parse(pathlib.Path(cost.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("torch") for m in names), names


def test_bench_cp_runs(capsys):
    from fived.bench import cp as bench

    assert bench.main(["--cp", "2", "--seq", "128", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "8", "--iters", "1", "--warmup", "0", "--json"]) == 0
    cap = capsys.readouterr()
    text = cap.out + cap.err  # with --json the table goes to stderr, the document to stdout
    assert "fived bench cp" in cap.err and "ring-contiguous" in text and "= formula" in text
    assert json.loads(cap.out.strip().splitlines()[-1])["bench"] == "cp"
    assert bench.main(["--cp", "3", "--seq", "64"]) == 2  # 64 is not divisible by 2·3


def test_ring_block_kernels_match_the_math():
    """The fused block kernels (here the CPU flash kernel) give the math's outputs, lse and
    gradients (benchmarks/ring_kernels.py; gpu_check runs it on the GPU's kernel)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import ring_kernels

    assert max(ring_kernels.gaps("cpu", causal=True, rep=2).values()) < ring_kernels.TOLERANCE
    assert max(ring_kernels.gaps("cpu", causal=False, rep=1).values()) < ring_kernels.TOLERANCE


@pytest.mark.parametrize("fused", [True, False])
def test_ring_block_on_the_dry_run_device_holds_no_scores(fused):
    """On the dry run's meta device (a GPU's stand-in) the ring's block runs the fused kernel:
    the largest tensor it makes is the block's output, never the s_q × s_k scores; the math
    path (``fused=False``) does make them — the check can fail."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fived.train.memtrace import LiveTensors

    b, g, rep, s, d = 1, 2, 2, 256, 16
    with FakeTensorMode(), LiveTensors() as trace:
        q = torch.empty(b, g, rep, s, d, device="meta")
        k, v = torch.empty(b, g, s, d, device="meta"), torch.empty(b, g, s, d, device="meta")
        start = trace.live
        o, lse = context._block_forward(q, k, v, True, 0.25, fused)
        lse = lse.contiguous()
        dq, dk, dv = context._block_backward(q, k, v, True, lse, q, o, lse, 0.25, fused)
        largest = trace.series[-1].peak - start
    assert o.shape == q.shape and lse.shape == q.shape[:-1] and dk.shape == k.shape
    scores = b * g * rep * s * s * 4
    assert (largest < scores) == fused, (largest, scores)
