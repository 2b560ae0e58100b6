"""ZeRO-3's fp8 parameter all-gather (``fived.parallel.data.fp8``): the tensorwise fp8 linears'
weights gathered in e4m3 with scales whose amax is reduced over the shards (and tp), so the
layout equals the one-rank fp8 run of the same recipe; the traffic and the gathered bytes
against the ledger.

Mutations seen to fail (each restored): the amax all-reduce over the shard group removed
(``test_zero3_fp8_gather_equals_one_rank_and_the_ledger``: losses 3.5e-2 apart, a weight held
wholly by the other rank cast with scale 1; ``test_gathered_fp8_weight_is_one_ranks_cast_to_
the_bit``); the amax all-reduce over tp removed (``test_gathered_fp8_weight_is_one_ranks_cast_
to_the_bit``: scale 2⁻¹¹ against 2; the slow whole-model tp2·dp2 run saw it only in its
traffic — power-of-2 scales change no rounding of a normal value); the ledger's fp8 bucket
split removed (the traffic check: the gathers counted at 4 bytes); the fp8 linear ignoring the
provided weight (``tests/test_fp8.py::test_dry_run_of_fp8_tp_sp_zero3_is_exact[tensorwise]``:
the W casts' tp amax reductions come back, 224 B per step more than the ledger's).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest

from fived.config import ParallelConfig, TrainConfig, preset

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, fp8_reference, train_runs  # noqa: E402,I001

TINY = replace(preset("tiny"), layers=2, seq_len=16)
TRAIN = TrainConfig(steps=3, global_batch=4, lr=3e-3, warmup=1, seed=7)


def _ledger_traffic(model, par, micro_batch):
    from fived.ledger.traffic import step_bytes

    return step_bytes(model, par, micro_batch)


@pytest.mark.parametrize("recipe,dp,recompute", [
    ("tensorwise", 2, "none"), ("rowwise", 2, "none"), ("blockwise", 2, "none"),
    pytest.param("rowwise", 4, "none", marks=pytest.mark.slow),
    pytest.param("blockwise", 4, "none", marks=pytest.mark.slow), ("rowwise", 2, "full")])
def test_zero3_fp8_gather_equals_one_rank_and_the_ledger(recipe, dp, recompute):
    """dp2 and dp4 ZeRO-3 under each --fp8 recipe with the fp8 gather equal the one-rank fp8
    run of that recipe (losses of 3 steps and first-step gradients to 1e-5, fp32 around the
    products); every rank's traffic of every step equals the ledger's to the byte (the fp8
    weights' gathers at 1 byte per element and cast — rowwise under full recompute: two casts
    in backward —, one all-reduce of each unit's tile amaxes per step), and its transient bytes
    (gathered units, gradient buffers, the step's scales) the ledger's replay; the dense group's
    bytes are under 0.75× the ledger's with the gather in the compute dtype (fp32 here: the
    fp8 weights' gathers at a quarter, the norms' and the root's unchanged, the reduce-scatter
    unchanged)."""
    from fived.ledger.verify import predict_buffers

    on = ParallelConfig(dp=dp, zero=3, precision="fp32", fp8=recipe, recompute=recompute)
    train = replace(TRAIN, global_batch=2 * dp)
    (out,) = train_runs([(TINY, on, train)])
    check_parity(out, fp8_reference(TINY, recipe, dp, train), on.describe())
    want = _ledger_traffic(TINY, on, 2)
    buffers = predict_buffers(TINY, on, train.global_batch, 0)
    for s in out["ranks"]:
        for h in s["history"]:
            assert h["traffic"] == pytest.approx(want, rel=1e-12, abs=0), h
            assert h["memory"]["buffers"] == buffers, (h["memory"], buffers)
    off = _ledger_traffic(TINY, replace(on, fp8_gather=False), 2)
    assert want["dense"] < 0.75 * off["dense"], (want, off)


def _gathered_weights(rank: int, world: int) -> dict:
    """tp2·dp2: two fp8 weights cut over tp (rows), laid out in one ZeRO-3 bucket over the dense
    group (dp2): W1 straddles the two shards, W2 lies wholly in the second; W1's tp halves differ
    2¹² in magnitude (a piece's own amax would give another scale). The gathered e4m3 bytes and
    scale of each piece against one rank's cast of the whole weight."""
    import torch

    from fived.comm.ops import Traffic
    from fived.model import fp8 as fp8_mod
    from fived.parallel.data.buckets import Bucket
    from fived.parallel.data.fp8 import Fp8Gather
    from fived.parallel.placement import Placement
    from fived.ranks.grid import Grid

    par = ParallelConfig(tp=2, dp=2, zero=3, fp8="tensorwise")
    grid = Grid.from_config(par, rank).connect(Traffic())
    tp = grid["tp"]
    g = torch.Generator().manual_seed(3)
    whole = {"layers.0.mlp.up_proj.weight": torch.randn(16, 24, generator=g) * 0.05,
             "layers.0.self_attn.o_proj.weight": torch.randn(8, 24, generator=g) * 0.05}
    whole["layers.0.mlp.up_proj.weight"][8:] *= 2 ** 12
    named, places = [], []
    for name, w in whole.items():
        piece = w.chunk(2, 0)[tp.rank].clone()
        named.append((name, torch.nn.Parameter(piece)))
        places.append(Placement(name, tuple(w.shape), 0, 2, tp.rank))
    b = Bucket(named, places, "dense", grid["dense"], 2, 0, 2, unit=0)
    b.param_full = torch.cat([p.detach().reshape(-1) for _, p in named])
    b.param_shard = b.param_full[b.lo:b.hi].clone()
    gather = Fp8Gather([b], {pl.name: pl for pl in places}, grid)
    assert gather.owns(b)
    for h in gather.start(b):
        h.wait()
    out = {}
    for (name, p), w in zip(named, whole.values()):
        q = fp8_mod._PROVIDED[id(p)]["w_dgrad"]
        want = fp8_mod.cast(w, "tensorwise", "w_dgrad")
        rows = want.data.view(torch.uint8).chunk(2, 0)[tp.rank]
        out[name] = (bool(torch.equal(q.data.view(torch.uint8), rows)),
                     float(q.scale), float(want.scale))
    gather.free(b)
    out["freed"] = not fp8_mod._PROVIDED and gather.full[(0, "w")].untyped_storage().nbytes() == 0
    return out


def test_gathered_fp8_weight_is_one_ranks_cast_to_the_bit():
    """The amax max-reduced over the shards and over tp: every rank's gathered e4m3 piece and
    its scale equal the one-rank cast of the whole weight, bit for bit (without the reduction
    over tp, W1's small half gets its own scale, 2¹² smaller); the free releases the bytes and
    withdraws the weights."""
    from fived.testing import run_ranks

    for r in run_ranks(_gathered_weights, 4):
        assert r.pop("freed"), r
        for name, (same, got, want) in r.items():
            assert same and got == want, (name, got, want)


def _gathered_tiles(rank: int, world: int, recipe: str, tp: int) -> dict:
    """tp·dp (dp = world/tp) ZeRO-3 flat shards of three fp8 weights whose rows and 128×128
    blocks the shard boundaries cut (o and up projections cut over tp by rows, a down projection
    by columns; W2's last rows and W3's first columns 2¹⁰ larger, so a piece's own amax would
    give other scales; at tp1 a row cut by a shard boundary holds its block's amax in its last
    column): each provided operand's e4m3 bytes and per-element scale against one rank's
    cast of the whole weight, cut as tp cuts it. (bytes equal, scales equal, operands) per
    weight; ``amaxes``: the floats the scales' all-reduce over the shards carried."""
    import torch

    from fived.comm.ops import Traffic
    from fived.model import fp8 as fp8_mod
    from fived.parallel.data.buckets import Bucket
    from fived.parallel.data.fp8 import Fp8Gather
    from fived.parallel.placement import Placement
    from fived.ranks.grid import Grid

    dp = world // tp
    par = ParallelConfig(tp=tp, dp=dp, zero=3, fp8=recipe)
    traffic = Traffic()
    grid = Grid.from_config(par, rank).connect(traffic)
    t = grid["tp"].rank if tp > 1 else 0
    g = torch.Generator().manual_seed(5)
    whole = {"layers.0.self_attn.o_proj.weight": (torch.randn(14, 136, generator=g) * 0.05, 0),
             "layers.0.mlp.up_proj.weight": (torch.randn(264, 136, generator=g) * 0.05, 0),
             "layers.0.mlp.down_proj.weight": (torch.randn(136, 264, generator=g) * 0.05, 1)}
    whole["layers.0.mlp.up_proj.weight"][0][-20:] *= 2 ** 10
    whole["layers.0.mlp.down_proj.weight"][0][:, :9] *= 2 ** 10
    if tp == 1:  # a row a shard starts inside: its last column (the second 128-tile) the
        # block's amax, so the piece's tiles must be counted from the row's column 0
        sizes = [w.numel() for w, _ in whole.values()]
        total = -(-sum(sizes) // dp) * dp
        for k in range(1, dp):
            at = k * total // dp
            for w, _ in whole.values():
                if 0 <= at < w.numel():
                    r, c = divmod(at, w.shape[1])
                    if c % 128:
                        w[r, -1] = 2.0 ** 6
                at -= w.numel()
    named, places = [], []
    for name, (w, dim) in whole.items():
        piece = w.chunk(tp, dim)[t].clone() if tp > 1 else w.clone()
        named.append((name, torch.nn.Parameter(piece)))
        places.append(Placement(name, tuple(w.shape), dim, tp, t))
    b = Bucket(named, places, "dense", grid["dense"], dp, 0, 2, unit=0)
    b.param_full = torch.cat([p.detach().reshape(-1) for _, p in named])
    b.param_shard = b.param_full[b.lo:b.hi].clone()
    gather = Fp8Gather([b], {pl.name: pl for pl in places}, grid, recipe)
    assert gather.owns(b)
    for h in gather.start(b):
        h.wait()
    amax_bytes = traffic.records[("dense", "all_reduce")].bytes
    out = {}
    for (name, p), (w, dim) in zip(named, whole.values()):
        got = fp8_mod._PROVIDED[id(p)]
        res = []
        for op in ("w_fwd", "w_dgrad"):
            q = got[op].t() if op == "w_fwd" else got[op]  # (N, K), as W
            want = fp8_mod.cast(w.t() if op == "w_fwd" else w, recipe, op)
            want = want.t() if op == "w_fwd" else want
            wd = want.data.view(torch.uint8)
            ws = fp8_mod.expand(want.scale, want.tile, tuple(w.shape))
            if tp > 1:
                wd, ws = wd.chunk(tp, dim)[t], ws.chunk(tp, dim)[t]
            gs = fp8_mod.expand(q.scale, q.tile, tuple(q.data.shape))
            res.append((bool(torch.equal(q.data.view(torch.uint8), wd)),
                        bool(torch.equal(gs, ws))))
        out[name] = res
    gather.free(b)
    out["freed"] = not fp8_mod._PROVIDED and all(
        f.untyped_storage().nbytes() == 0 for f in gather.full.values())
    out["amax bytes"] = amax_bytes
    return out


@pytest.mark.parametrize("recipe,tp,world", [("rowwise", 1, 2), ("blockwise", 1, 4),
                                             ("rowwise", 2, 4), ("tensorwise", 1, 4)])
def test_gathered_tiles_are_one_ranks_cast_to_the_bit(recipe, tp, world):
    """Rowwise and blockwise over flat shards that cut rows and blocks: every rank's gathered
    e4m3 operands (rowwise: the per-row Wᵀ and the per-column W; blockwise: one cast serving
    both) and their per-element scales equal one rank's cast of the whole weight, bit for bit
    (tp2: the amaxes spanning the cut reduced over tp as well); the scales' all-reduce carries
    the recipe's amaxes (rowwise N + K per weight, blockwise ⌈N/128⌉·⌈K/128⌉, tensorwise 1)."""
    from fived.comm.volume import bytes_sent
    from fived.parallel.data.fp8 import amax_count
    from fived.testing import run_ranks

    shapes = [(14 // tp, 136), (264 // tp, 136), (136, 264 // tp)]
    floats = sum(amax_count(recipe, s) for s in shapes)
    dp = world // tp
    for r in run_ranks(_gathered_tiles, world, recipe, tp):
        assert r.pop("freed"), r
        assert r.pop("amax bytes") == bytes_sent("all_reduce", 4 * floats, dp), r
        for name, ops in r.items():
            assert all(same and scale for same, scale in ops), (name, ops)


@pytest.mark.slow
def test_zero3_fp8_gather_under_tp_and_ep_equals_one_rank():
    """tp2·dp2 ZeRO-3 (the amax reduced over tp as well: the tp-cut linears' scale is the
    whole weight's) and ep2·dp2 ZeRO-3 of a MoE model (the experts' own bucket gathered over
    the expert group), both with the fp8 gather, against the one-rank fp8 run; every rank's
    traffic equals the ledger's."""
    moe = replace(preset("tiny-moe"), layers=2, seq_len=16)
    layouts = [(TINY, ParallelConfig(tp=2, dp=2, zero=3, precision="fp32", fp8="tensorwise"), 2),
               (moe, ParallelConfig(ep=2, dp=2, zero=3, precision="fp32", fp8="tensorwise"), 4)]
    outs = train_runs([(m, p, TRAIN) for m, p, _ in layouts])
    for (m, par, micro), out in zip(layouts, outs):
        check_parity(out, fp8_reference(m, "tensorwise", micro, TRAIN), par.describe())
        want = _ledger_traffic(m, par, TRAIN.global_batch // (par.dp * par.ep))
        if not m.is_moe:  # MoE: the ep all-to-all follows the router (test_expert's check)
            for s in out["ranks"]:
                assert s["history"][-1]["traffic"] == pytest.approx(want, rel=1e-12), s


GATHER_LAYOUTS = [
    ("tiny", "--pp 2 --dp 2 --zero 3 --micro-batches 2", "tensorwise"),
    ("tiny", "--pp 2 --dp 2 --zero 3 --micro-batches 2 --zero3-pp-gather step", "tensorwise"),
    ("tiny", "--dp 4 --dp-shard 2 --zero 3", "tensorwise"),
    ("tiny", "--dp 4 --zero 3 --recompute full --micro-batches 2", "tensorwise"),
    ("tiny-moe", "--ep 2 --dp 2 --tp 2 --zero 3", "tensorwise"),
    ("tiny", "--pp 2 --dp 2 --zero 3 --micro-batches 2", "blockwise"),
    ("tiny", "--dp 4 --dp-shard 2 --zero 3", "rowwise"),
    ("tiny", "--dp 4 --zero 3 --recompute full --micro-batches 2", "rowwise"),
    ("tiny-moe", "--ep 2 --dp 2 --tp 2 --zero 3", "rowwise"),
    ("tiny-moe", "--ep 2 --dp 2 --zero 3", "blockwise"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,layout,recipe", GATHER_LAYOUTS)
def test_dry_run_of_the_fp8_gather_is_exact(tmp_path, model, layout, recipe):
    """`fived train --dry-run --fp8 R` with ZeRO-3 under pp (the executor's driven gathers, per
    micro-batch and per step), hybrid sharding (the scales reduced over the shard part), full
    recompute (rowwise: both casts in backward) and MoE with ep and tp, then `fived ledger
    --check`: every rank's traffic and model states exact."""
    from parity_helpers import dry_run_is_exact

    dry_run_is_exact(tmp_path, "--model", model, "--fp8", recipe, "--precision", "bf16",
                     *layout.split())
