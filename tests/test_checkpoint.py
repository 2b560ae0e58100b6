"""Checkpoints (fived.checkpoint): bit-exact resume on the same layout, resharding to another
layout, atomic saves that survive kill -9, clear errors. docs/checkpoints.md.

Every multi-rank test trains several runs in one spawn (process start-ups dominate tiny runs):
the run that never stops, the run that stops after ``K`` steps and saves, and the resumed run."""

from __future__ import annotations

import os
import pickle
import signal
from dataclasses import replace

import pytest
import torch

from fived.checkpoint.pieces import Pieces, boxes
from fived.checkpoint.storage import safe_unpickle
from fived.config import PRESETS, ParallelConfig
from fived.ranks.launch import RankFailure
from fived.testing import rel_diff, run_ranks, small_train

DENSE, MOE = PRESETS["tiny"], PRESETS["tiny-moe"]
K = 3
TRAIN = small_train(steps=5)


def _losses(rank: int, world: int, runs: list) -> list[list[float]]:
    from fived.train.trainer import train_rank

    return [train_rank(rank, world, m, p, t, show=False)["losses"] for m, p, t in runs]


def _triple(m, par, t, d):
    """(the straight run, K steps then save to d, resume from d)."""
    return [(m, par, t), (m, par, replace(t, stop_after=K, save_dir=str(d))),
            (m, par, replace(t, resume=str(d)))]


# ------------------------------------------------------------------ pieces (no ranks)
@pytest.mark.parametrize("shape", [(5,), (4, 6), (3, 4, 5), (2, 3, 2, 4)])
def test_boxes_cover_every_element_range_exactly(shape):
    n = 1
    for s in shape:
        n *= s
    full = torch.arange(n).view(shape)
    for a in range(0, n, 3):
        for b in range(a + 1, n + 1, 5):
            got = []
            bs = boxes(shape, a, b)
            assert len(bs) <= 2 * len(shape) - 1
            for off, sz in bs:
                sl = tuple(slice(o, o + s) for o, s in zip(off, sz))
                got.append(full[sl].reshape(-1))
            assert torch.equal(torch.cat(got), torch.arange(a, b)), (shape, a, b)


def test_pieces_are_views_with_global_offsets():
    flat = torch.arange(10.0)  # elements 3..12 of a (2, 8) piece at row 4 of a (8, 8) tensor
    p = Pieces((8, 8), torch.float32)
    p.add_range(flat, (2, 8), (4, 0), 3, 13)
    assert [o for o, _ in p.items] == [(4, 3), (5, 0)]
    p.items[1][1][0, 0] = -1
    assert flat[5] == -1  # a view: saving copies nothing
    assert p.size() == torch.Size((8, 8)) and p.numel() == 10


def test_metadata_unpickler_refuses_code():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        safe_unpickle(pickle.dumps(Evil()))
    assert safe_unpickle(pickle.dumps(torch.Size([2, 3]))) == torch.Size([2, 3])


def test_metadata_with_pickled_objects_is_refused(tmp_path):
    """DCP would torch.load(weights_only=False) a non-tensor entry: the reader refuses it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from fived.checkpoint.storage import safe_reader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"x": torch.ones(2), "obj": {"a": 1}}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(pickle.UnpicklingError, match="non-tensor entries"):
        safe_reader(tmp_path).read_metadata()


# ------------------------------------------------------------------ bit-exact and reshard
SAVED = {  # saved on 2 ranks
    "dense-dp2-z1": (DENSE, ParallelConfig(dp=2, zero=1)),
    "moe-ep2-z2": (MOE, ParallelConfig(ep=2, zero=2)),
    "dense-tp2-sp": (DENSE, ParallelConfig(tp=2, sequence_parallel=True)),
    "dense-pp2-v2": (DENSE, ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2,
                                           micro_batches=4, zero=1)),
    "moe-cp2-z3": (MOE, ParallelConfig(ep=1, cp=2, zero=3)),
}
RESUMED = [  # (saved, layout it resumes under, on 4 ranks)
    ("dense-dp2-z1", ParallelConfig(tp=2, pp=2)),
    ("moe-ep2-z2", ParallelConfig(ep=4, zero=1)),
    ("dense-tp2-sp", ParallelConfig(dp=4, zero=3)),
    ("dense-pp2-v2", ParallelConfig(cp=2, dp=2, zero=2, cp_mode="ulysses")),
    ("dense-dp2-z1", ParallelConfig(pp=4, schedule="zb-h1", micro_batches=4)),
    ("moe-cp2-z3", ParallelConfig(ep=2, tp=2, zero=1)),
    ("dense-tp2-sp", ParallelConfig(pp=2, dp=2, schedule="interleaved", virtual_stages=2,
                                    micro_batches=4, zero=2)),
    ("moe-ep2-z2", ParallelConfig(ep=2, pp=2, micro_batches=2, precision="fp32")),
]
DEFAULT = ("dense-dp2-z1", "moe-ep2-z2")


def _reshard(tmp_path, names, resumed, also=()):
    """Save each of ``names`` on 2 ranks after K steps (with the straight runs, and ``also``
    runs in the same spawn), resume each under its ``resumed`` layout on 4 ranks; the losses
    of ``also``."""
    runs = []
    for name in names:
        runs += _triple(*SAVED[name], TRAIN, tmp_path / name)[:2]
    ref = run_ranks(_losses, 2, runs + list(also), timeout=900)[0]
    for i, name in enumerate(names):  # the interrupted run equals the straight one so far
        assert ref[2 * i + 1] == ref[2 * i][:K], name
    full = {name: ref[2 * i] for i, name in enumerate(names)}
    out = run_ranks(_losses, 4, [(SAVED[name][0], par, replace(TRAIN, resume=str(tmp_path / name)))
                                 for name, par in resumed], timeout=900)[0]
    for (name, par), got in zip(resumed, out):
        assert len(got) == TRAIN.steps - K
        assert rel_diff(got, full[name][K:]) < 1e-5, (name, par.describe(), got, full[name][K:])
    return ref[2 * len(names):]


def test_reshard_dense_and_moe_and_async_bit_exact(tmp_path):
    """dp2·ZeRO-1 -> tp2·pp2 (ZeRO-0); MoE ep2·ZeRO-2 -> ep4·ZeRO-1 (2 -> 4 ranks), within
    1e-5 of the run that never stopped. In the same spawn: the same layout (dp2·ZeRO-2) with
    --async-save resumes bit for bit."""
    par = ParallelConfig(dp=2, zero=2)
    full, first, rest = _reshard(tmp_path, DEFAULT, RESUMED[:2],
                                 _triple(DENSE, par, replace(TRAIN, async_save=True),
                                         tmp_path / "async"))
    assert first + rest == full


@pytest.mark.slow
def test_reshard_matrix(tmp_path):
    """dp <-> tp(+SP) <-> pp (interleaved, zb-h1) <-> cp (ring, Ulysses) <-> ep, every ZeRO
    stage on either side, 2 -> 4 ranks; and 2 -> 1 rank."""
    _reshard(tmp_path, list(SAVED), RESUMED)
    one = run_ranks(_losses, 1, [(m, ParallelConfig(), replace(TRAIN, resume=str(tmp_path / n)))
                                 for n, (m, _) in SAVED.items()], timeout=900)[0]
    full = run_ranks(_losses, 1, [(m, ParallelConfig(), TRAIN) for m, _ in SAVED.values()],
                     timeout=900)[0]
    for got, ref in zip(one, full):
        assert rel_diff(got, ref[K:]) < 1e-5


BIT_EXACT = [
    (DENSE, ParallelConfig(dp=4, zero=3)),
    (DENSE, ParallelConfig(dp=4, zero=0, precision="bf16")),
    (DENSE, ParallelConfig(dp=4, zero=1, precision="fp16")),
    (DENSE, ParallelConfig(tp=2, dp=2, zero=2, sequence_parallel=True)),
    (DENSE, ParallelConfig(pp=2, dp=2, zero=1, schedule="interleaved", virtual_stages=2,
                           micro_batches=4)),
    (DENSE, ParallelConfig(pp=4, schedule="1f1b", micro_batches=4)),
    (DENSE, ParallelConfig(pp=2, dp=2, schedule="gpipe", micro_batches=2, zero=2)),
    (DENSE, ParallelConfig(pp=2, tp=2, schedule="zb-h1", micro_batches=4)),
    (DENSE, ParallelConfig(cp=2, dp=2, zero=0, precision="bf16")),
    (DENSE, ParallelConfig(cp=4, cp_mode="ulysses", zero=1)),
    (MOE, ParallelConfig(ep=2, dp=2, zero=1)),
    (MOE, ParallelConfig(ep=4, zero=3)),
    (MOE, ParallelConfig(ep=2, pp=2, micro_batches=2)),
    (DENSE, ParallelConfig(pp=2, dp=2, zero=3, schedule="zb-v", virtual_stages=2,
                           micro_batches=2)),
    (DENSE, ParallelConfig(pp=2, dp=2, zero=3, zero3_pp_gather="micro", schedule="dualpipe-v",
                           virtual_stages=2, micro_batches=4)),
]


@pytest.mark.slow
def test_resume_is_bit_exact_on_the_same_layout(tmp_path):
    """Each dimension, each ZeRO stage, every pp schedule, MoE, bf16 and fp16 (loss scaler)."""
    runs = []
    for i, (m, par) in enumerate(BIT_EXACT):
        runs += _triple(m, par, TRAIN, tmp_path / f"c{i}")
    out = run_ranks(_losses, 4, runs, timeout=1800)[0]
    for i, (_, par) in enumerate(BIT_EXACT):
        full, first, rest = out[3 * i:3 * i + 3]
        assert len(first) == K and len(rest) == TRAIN.steps - K
        assert first + rest == full, (par.describe(), full, first + rest)


# ------------------------------------------------------------------ atomic: kill -9
def _killed_during_save(rank: int, world: int, m, par, t, kill_step: int, when: str):
    """Train with saves; one rank dies by SIGKILL during the save of step ``kill_step``:
    ``rename``: rank 0 once every rank's data is written, before the manifest and the rename;
    ``write``: rank 1 as it starts writing its data file."""
    from torch.distributed.checkpoint import filesystem

    from fived.checkpoint import storage
    from fived.train.trainer import train_rank

    real_finalize, real_write = storage.finalize, filesystem.FileSystemWriter.write_data

    def finalize(root, step, manifest, keep=0):
        if when == "rename" and step == kill_step and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_finalize(root, step, manifest, keep)

    def write_data(self, plan, planner):
        if when == "write" and rank == 1 and f"step-{kill_step:06d}" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, plan, planner)

    storage.finalize = finalize
    filesystem.FileSystemWriter.write_data = write_data
    return train_rank(rank, world, m, par, t, show=False)["losses"]


@pytest.mark.parametrize("when", ["rename", pytest.param("write", marks=pytest.mark.slow)])
def test_kill9_during_save_leaves_the_previous_checkpoint(tmp_path, when):
    d = tmp_path / "ck"
    par = ParallelConfig(dp=2, zero=2)
    t = replace(TRAIN, steps=6, save_dir=str(d), save_every=2)
    with pytest.raises(RankFailure):
        run_ranks(_killed_during_save, 2, DENSE, par, t, 4, when, timeout=300)
    names = sorted(p.name for p in d.iterdir())
    assert "step-000002" in names and "step-000004" not in names, names
    assert ".tmp-step-000004" in names  # hidden, never read
    from fived.checkpoint import resolve

    assert resolve(d).name == "step-000002"
    full, resumed = run_ranks(_losses, 2, [(DENSE, par, replace(t, save_dir="")),
                                           (DENSE, par, replace(t, resume=str(d),
                                                                save_dir=str(d)))],
                              timeout=600)[0]
    assert resumed == full[2:]
    assert not (d / ".tmp-step-000004").exists()  # the next save cleaned it
    assert resolve(d).name == "step-000006"


def test_architecture_page_draws_the_checkpoint_arrows():
    """docs/architecture.md's ``checkpoint ->`` line is what fived.checkpoint imports."""
    from pathlib import Path

    from test_imports import ROOT, documented_arrows, package_arrows

    real = package_arrows(ROOT, "fived")
    doc = documented_arrows((Path(ROOT) / "docs" / "architecture.md").read_text())
    assert doc["checkpoint"] == real["checkpoint"], (doc["checkpoint"], real["checkpoint"])
