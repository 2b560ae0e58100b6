"""Born sharded (fived.model.init, fived.parallel.data.layout.Layout.fill): the model is built on
the meta device, cut there, and each rank materialises only its own pieces.

* any slice of a parameter drawn block by block equals the same slice of the full draw, bit for
  bit, in every dtype (rows, columns, many parts, tensors that are not a multiple of a block);
* the pieces every rank of tp2·pp2 (ZeRO-1), tp4 (replicated kv heads, ZeRO-3) and ep2·tp2
  (MoE, ZeRO-2) holds after the build assemble to the one-rank model, bit for bit;
* a rank's resident memory after the build is its own model states, not the whole model
  (measured with ``getrusage``; the whole-model build fails it: ``test_..._mutation``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fived.config import PRESETS, ModelConfig, ParallelConfig
from fived.model import build_model
from fived.model.init import TILE, fill_piece, full_param
from fived.testing import run_ranks, small_train


@pytest.mark.parametrize("shape", [(600, 520), (TILE, TILE), (3, 1000), (1000,), (4, 6, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slice_is_the_slice_of_the_full_draw(shape, dtype):
    full = full_param(3, "layers.0.w", shape, 0.02)
    for dim in sorted({0, len(shape) - 1}):
        for parts in (1, 2, 4):
            if shape[dim] % parts:
                continue
            pieces = [fill_piece(torch.empty(full.chunk(parts, dim)[i].shape, dtype=dtype), 3,
                                 "layers.0.w", shape, 0.02, dim, parts, i) for i in range(parts)]
            assert torch.equal(torch.cat(pieces, dim), full.to(dtype)), (dim, parts)


def test_values_depend_on_seed_and_name_only():
    a = full_param(3, "x", (300, 300), 0.02)
    assert torch.equal(a, full_param(3, "x", (300, 300), 0.02))
    assert not torch.equal(a, full_param(4, "x", (300, 300), 0.02))
    assert not torch.equal(a, full_param(3, "y", (300, 300), 0.02))
    blocks = [a[:TILE, :TILE], a[:TILE, TILE:2 * TILE - 212], a[TILE:, :TILE]]
    assert all(abs(float(b.std()) - 0.02) < 0.002 for b in blocks)  # no block repeats another
    assert not torch.equal(blocks[0][:44, :44], blocks[2][:44, :44])


# ------------------------------------------------------------------ every rank's pieces
def _pieces(rank: int, world: int, jobs: list) -> list:
    from fived.train.trainer import Trainer

    out = []
    for cfg, par in jobs:
        t = Trainer(cfg, par, small_train(), rank, world)
        assert not any(p.is_meta for p in t.stage.parameters())
        full = t.engine.full_params()  # this rank's tp/ep pieces, whole over ZeRO
        out.append({n: (t.parallel.placements[n], v.numpy()) for n, v in full.items()})
        t.close()
    return out


def _assemble(ranks: list[dict]) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for n, (pl, v) in rank.items():
            whole = got.setdefault(n, torch.full(pl.shape, float("nan")))
            size = pl.shape[pl.dim] // pl.parts
            piece, v = whole.narrow(pl.dim, pl.index * size, size), torch.from_numpy(v)
            assert torch.isnan(piece).all() or torch.equal(piece, v), n  # replicas agree
            piece.copy_(v)
    return got


def test_every_layout_holds_pieces_of_the_one_rank_model():
    tiny, moe = PRESETS["tiny"], PRESETS["tiny-moe"]
    jobs = [(tiny, ParallelConfig(tp=2, pp=2, zero=1)),
            (replace(tiny, kv_heads=2), ParallelConfig(tp=4, zero=3)),
            (moe, ParallelConfig(ep=2, tp=2, zero=2, sequence_parallel=True))]
    res = run_ranks(_pieces, 4, jobs, timeout=600)
    for i, (cfg, _) in enumerate(jobs):
        ref = dict(build_model(cfg, small_train().seed).named_parameters())
        got = _assemble([r[i] for r in res])
        assert set(got) == set(ref)
        for n, v in got.items():
            assert torch.equal(v, ref[n].detach()), (i, n)


# ------------------------------------------------------------------ memory
WIDE = ModelConfig(name="wide", vocab=32768, hidden=768, layers=2, heads=12, kv_heads=4,
                   ffn=2048, seq_len=16)


def _build_rss(rank: int, world: int, par: ParallelConfig, whole: bool) -> dict:
    from fived.ledger.verify import predict_rank
    from fived.train import trainer
    from fived.train.metrics import rss_peak

    trainer.Trainer(PRESETS["tiny"], par, small_train(global_batch=2), rank, world).close()
    before = rss_peak()  # the process's fixed costs (imports, threads, groups) paid
    if whole:  # the habit this replaces: the whole model drawn on every rank, then cut
        keep = build_model(WIDE, 7)
        rss_peak()
    else:
        keep = None
    t = trainer.Trainer(WIDE, par, small_train(global_batch=2), rank, world)
    led = predict_rank(WIDE, par, 2, rank)[0]
    out = {"delta": t.build_rss - before, "states": sum(led.values())}
    del keep
    t.close()
    return out


def _model_bytes() -> int:
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in build_model(WIDE, 0, init=False).parameters())


def _check_build(whole: bool) -> None:
    res = run_ranks(_build_rss, 2, ParallelConfig(tp=2), whole, timeout=600)
    full = _model_bytes()
    for r in res:  # its own states (params, grads, master, Adam) and slack, never the model
        assert r["delta"] <= r["states"] + 0.25 * full, (r, full)


def test_a_rank_builds_only_its_own_states():
    _check_build(whole=False)


def test_the_memory_check_fails_on_a_whole_model_build_mutation():
    with pytest.raises(AssertionError):
        _check_build(whole=True)


def test_a_layout_too_big_for_the_machine_is_warned_before_any_rank(capsys):
    from fived.cli.train import warn_if_too_big

    train = small_train()
    assert not warn_if_too_big(PRESETS["tiny"], ParallelConfig(), train, 1)
    assert warn_if_too_big(PRESETS["llama3-8b"], ParallelConfig(), train, 1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the ledger gives the largest rank" in err[0]


M336 = ModelConfig(name="small", vocab=32000, hidden=1024, layers=24, heads=16, kv_heads=4,
                   ffn=2816, seq_len=128)


def _build_336m(rank: int, world: int, par: ParallelConfig) -> dict:
    from fived.ledger.memory import rank_memory
    from fived.train import trainer

    t = trainer.Trainer(M336, par, small_train(global_batch=4), rank, world)
    led = rank_memory(M336, par, 1, t.coords["pp"]).total
    out = {"build": t.build_rss, "ledger": led}
    t.close()
    return out


@pytest.mark.slow
def test_the_336m_model_builds_within_its_ledger_bound():
    """The issue's measurement (docs/checkpoints.md): the 336M Llama at tp2·pp2·dp2, 8 ranks;
    each rank's peak RSS after the build ≤ 1.3 × its ledger total + a bare process (0.3 GB).
    Before born sharding the largest rank was 2.73 GB after the build; the bound is 2.26 GB."""
    res = run_ranks(_build_336m, 8, ParallelConfig(tp=2, pp=2, dp=2, micro_batches=2),
                    timeout=1200)
    for r in res:
        assert r["build"] <= 1.3 * r["ledger"] + 0.3e9, r
