"""Every dimension at once: a 3-D, a 4-D and the full 5-D layout equal the one-rank run.

* 3-D  tp2·pp2·dp2 (8 ranks) of tiny, with sequence parallelism and ZeRO-2;
* 4-D  ep2·tp2·cp2·pp2 (16 ranks) of tiny-moe (dense gradients reduced over ep·cp, DDP);
* 5-D  tp2·cp2·ep2·pp2·dp2 (32 ranks) of tiny-moe, with ZeRO-1.

Each trains 2 steps of a global batch of 8 sequences (2 micro-batches) and must match the
one-rank run of the same model and data in the losses of both steps (1e-5 relative) and in
every parameter's full first-step gradient, gathered from all ranks' pieces to its global name
and shape (``fived.testing.train_with_grads``; 1e-5 relative in the L2 norm). The metrics JSONL
the run writes is then checked by ``fived ledger --check``: every rank's model-state bytes and
bytes sent per group, on every step, equal the ledger's to the byte.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fived.config import ParallelConfig, TrainConfig, preset
from fived.testing import grad_rel_diff, rel_diff, train_with_grads

TINY, MOE = preset("tiny"), preset("tiny-moe")
TRAIN = TrainConfig(steps=2, global_batch=8, lr=3e-3, warmup=1, seed=7)
TOL = 1e-5


@pytest.fixture(scope="module")
def references():
    """The one-rank run of each model, in this process: (losses, first-step gradients)."""
    from fived.testing import assemble_grads, train_recording

    out = {}
    for m in (TINY, MOE):
        s = train_recording(0, 1, m, ParallelConfig(), TRAIN)
        out[m.name] = (s["losses"], assemble_grads([s["grads"]]))
    return out


def check_layout(model, par: ParallelConfig, ref, path, timeout: float) -> None:
    from fived.cli import main
    from fived.config import validate
    from fived.ledger import verify

    train = replace(TRAIN, metrics_out=str(path))
    validate(model, par, train, par.world_size)  # a rejected layout fails here, saying why
    losses, grads = train_with_grads(model, par, train, timeout=timeout)
    ref_losses, ref_grads = ref
    assert len(losses) == TRAIN.steps
    assert rel_diff(losses, ref_losses) < TOL, (losses, ref_losses)
    g = grad_rel_diff(grads, ref_grads)
    assert g < TOL, g
    # the ledger, from the file alone: every step of it, then the CLI on it (its last step)
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(recs) == TRAIN.steps
    assert verify.run_of_file(str(path)) == (model, par, TRAIN.global_batch)
    assert [len(r["memory_per_rank"]) for r in recs] == [par.world_size] * TRAIN.steps
    for r in recs:
        assert verify.compare_record(model, par, TRAIN.global_batch, r) == [], r["step"]
    assert main(["ledger", "--check", str(path)]) == 0


def test_3d_tp_sp_pp_dp_zero2(references, tmp_path):
    par = ParallelConfig(tp=2, pp=2, dp=2, sequence_parallel=True, zero=2, micro_batches=2)
    assert par.world_size == 8
    check_layout(TINY, par, references["tiny"], tmp_path / "3d.jsonl", timeout=600)


def test_4d_ep_tp_cp_pp(references, tmp_path):
    par = ParallelConfig(ep=2, tp=2, cp=2, pp=2, micro_batches=2)
    assert par.world_size == 16
    check_layout(MOE, par, references["tiny-moe"], tmp_path / "4d.jsonl", timeout=600)


@pytest.mark.slow  # 26 s; its fast siblings: test_4d_ep_tp_cp_pp and test_3d_tp_sp_pp_dp_zero2
def test_5d_tp_cp_ep_pp_dp_zero1(references, tmp_path):
    """Time: 32 ranks on 2 cores (~25 s quiet); the only test of all five dimensions at once."""
    par = ParallelConfig(tp=2, cp=2, ep=2, pp=2, dp=2, zero=1, micro_batches=2)
    assert par.world_size == 32
    check_layout(MOE, par, references["tiny-moe"], tmp_path / "5d.jsonl", timeout=900)
