"""DDP and ZeRO-1/2/3: parity with one rank (fp32), model-state bytes and traffic per rank
equal to the ZeRO formulas exactly (plus the reported padding) and overlap.

Parity means the losses of all 5 steps on every rank (1e-5 relative) *and* every parameter's
full first-step gradient, gathered from the ranks' pieces (ZeRO shards included) to its global
name and shape, against the one-rank run (1e-5 relative in the L2 norm, ``check_parity``): a
reduced gradient off by 2× in one bucket leaves the losses within 1e-5 (AdamW's m/√v cancels a
per-parameter scale) but not the gradients. The default layouts share one 2-rank spawn with the
overlap probe; the slow matrix trains all layouts of a world size in one spawn.
"""

from __future__ import annotations

import os
import sys

import pytest

from fived.config import ModelConfig, ParallelConfig, preset
from fived.testing import rank_runs, run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, gathered, one_rank, train_runs  # noqa: E402,I001

MODEL = preset("tiny")
TRAIN = small_train()
# odd sizes: every flat buffer needs padding to be split over 2 or 4 ranks
ODD = ModelConfig(name="odd", vocab=257, hidden=18, layers=2, heads=1, kv_heads=1, ffn=45,
                  seq_len=16)

# a default subset touching every stage (dp 4: the slow matrix and the bytes test),
# accumulation on/off, small buckets (several buckets in flight), and --no-overlap
DEFAULT = [
    ParallelConfig(dp=2, zero=0, micro_batches=2, bucket_mb=0.05),
    ParallelConfig(dp=2, zero=1, micro_batches=1, bucket_mb=0.1, overlap=False),
    ParallelConfig(dp=2, zero=2, micro_batches=2, bucket_mb=0.05),
    ParallelConfig(dp=2, zero=3, micro_batches=1),
]


@pytest.fixture(scope="module")
def reference():
    """The one-rank run (losses, first-step gradients), in this process."""
    ref = one_rank(MODEL, TRAIN)
    assert len(ref["losses"]) == 5 and ref["losses"][-1] < ref["losses"][0]
    return ref


def _world2(rank: int, world: int) -> dict:
    """Everything the default suite trains on 2 ranks, in one spawn."""
    return {"runs": rank_runs(rank, world, [(MODEL, p, TRAIN) for p in DEFAULT]),
            "overlap": _overlap_probe(rank, world),
            "metrics_calls": _metrics_all_reduces(rank, world)}


@pytest.fixture(scope="module")
def world2():
    per_rank = run_ranks(_world2, 2, timeout=600)
    return {"runs": [gathered([r["runs"][i] for r in per_rank]) for i in range(len(DEFAULT))],
            "overlap": per_rank[0]["overlap"],
            "metrics_calls": [r["metrics_calls"] for r in per_rank]}


@pytest.mark.parametrize("i", range(len(DEFAULT)), ids=[f"zero{p.zero}" for p in DEFAULT])
def test_zero_parity(reference, world2, i):
    out = world2["runs"][i]
    assert all(len(s["losses"]) == 5 for s in out["ranks"])
    check_parity(out, reference, DEFAULT[i])


MATRIX = [ParallelConfig(dp=dp, zero=zero, micro_batches=micro, bucket_mb=0.1)
          for dp in (2, 4) for zero in (0, 1, 2, 3) for micro in (1, 2)]
_matrix: dict = {}


def matrix_run(par: ParallelConfig) -> dict:
    """``par``'s run; the first call for a world size trains all of its layouts in one spawn."""
    if par not in _matrix:
        group = [p for p in MATRIX if p.world_size == par.world_size]
        _matrix.update(zip(group, train_runs([(MODEL, p, TRAIN) for p in group])))
    return _matrix[par]


@pytest.mark.slow
@pytest.mark.parametrize("par", MATRIX, ids=lambda p: f"dp{p.dp}-zero{p.zero}-m{p.micro_batches}")
def test_zero_parity_matrix(reference, par):
    check_parity(matrix_run(par), reference, par)


# ---------------------------------------------------------------- ledger agreement

GRAD_BYTES = {("fp32", "fp32"): 4, ("bf16", "fp32"): 4, ("bf16", "bf16"): 2}
PARAM_BYTES = {"fp32": 4, "bf16": 2}


def zero_formula(psi: int, n: int, zero: int, precision: str, grad_dtype: str) -> float:
    """Model-state bytes per rank: P params + G grads + M fp32 master + 8 Adam, with ZeRO
    dividing (M+8), then G, then P by N. fp32 has no separate master (the params are it)."""
    P = PARAM_BYTES[precision]
    G = GRAD_BYTES[(precision, grad_dtype)]
    M = 0 if precision == "fp32" else 4
    O = 8  # noqa: E741 - Adam m and v
    if zero == 0:
        return psi * (P + G + M + O)
    if zero == 1:
        return psi * (P + G) + psi * (M + O) / n
    if zero == 2:
        return psi * P + psi * (G + M + O) / n
    return psi * (P + G + M + O) / n


def _measure(rank: int, world: int, model: ModelConfig, cases: list[tuple]) -> list[dict]:
    from fived.train.trainer import Trainer

    out = []
    for zero, precision, grad_dtype in cases:
        par = ParallelConfig(dp=world, zero=zero, precision=precision,
                             grad_reduce_dtype=grad_dtype, bucket_mb=0.01)
        t = Trainer(model, par, small_train(steps=1, global_batch=world), rank, world)
        rec = t.step(0)
        psi = sum(p.numel() for p in t.engine.params)
        mem = t.engine.memory()
        root = (sum(b.padded * b.param_full.element_size() for b in t.engine.root.buckets)
                if zero == 3 else 0)  # ZeRO-3's root: gathered once a micro-batch
        out.append({"case": (zero, precision, grad_dtype), "psi": psi, "memory": mem,
                    "root_bytes": root,
                    "traffic": t.traffic.as_dict().get("dense", {}), "loss": rec["loss"],
                    "master_dtypes": {str(b.master.dtype) for b in t.engine.buckets}})
    return out


CASES = [(z, p, g) for z in (0, 1, 2, 3) for p, g in (("fp32", "fp32"), ("bf16", "fp32"),
                                                        ("bf16", "bf16"))]


@pytest.mark.parametrize("n", [4])
def test_model_state_bytes_and_traffic_match_formulas(n):
    results = run_ranks(_measure, n, ODD, CASES)
    for rank_results in results:
        for r in rank_results:
            zero, precision, grad_dtype = r["case"]
            m = r["memory"]
            state = m["params"] + m["grads"] + m["master"] + m["optimizer"]
            want = zero_formula(r["psi"], n, zero, precision, grad_dtype)
            assert state == want + m["padding"], (r["case"], state, want, m)
            assert (m["padding"] > 0) == (zero > 0), r["case"]
            assert r["master_dtypes"] == {"torch.float32"}
            # traffic: every collective on the dense group, bytes of the (padded) buffers
            full_grads = m["grads"] * (1 if zero <= 1 else n)
            full_params = m["params"] * (1 if zero <= 2 else n)
            tr = r["traffic"]
            f = (n - 1) / n
            if zero == 0:
                assert set(tr) == {"all_reduce"}
                assert tr["all_reduce"]["bytes"] == pytest.approx(2 * f * full_grads, rel=1e-12)
            else:
                assert tr["reduce_scatter"]["bytes"] == pytest.approx(f * full_grads, rel=1e-12)
                # ZeRO-3: each block gathered for its forward and its backward, the root
                # (embedding, norm, head) once: it stays gathered from forward to backward
                ag = f * (2 * full_params - r["root_bytes"] if zero == 3 else full_params)
                assert r["root_bytes"] > 0 or zero < 3
                assert tr["all_gather"]["bytes"] == pytest.approx(ag, rel=1e-12)
                if zero == 3 and full_grads == full_params:  # (3Ψ − Ψ_root)(N−1)/N · P
                    total = tr["reduce_scatter"]["bytes"] + tr["all_gather"]["bytes"]
                    assert total == pytest.approx(f * (3 * full_params - r["root_bytes"]),
                                                  rel=1e-12)
    # the same first-step loss in every mode of one precision
    losses = {r["case"]: r["loss"] for r in results[0]}
    for (_z, p, g), loss in losses.items():
        assert loss == pytest.approx(losses[(0, p, g)], rel=1e-5 if p == "fp32" else 1e-2)


# ---------------------------------------------------------------- overlap


def _overlap_probe(rank: int, world: int) -> dict:
    from fived.train.trainer import Trainer

    out = {}
    for overlap in (True, False):
        par = ParallelConfig(dp=world, bucket_mb=0.05, micro_batches=2, overlap=overlap)
        t = Trainer(MODEL, par, small_train(steps=1), rank, world)
        e = t.engine
        x, y, pos = t.local_data(0)
        e.zero_grad()
        launched = []
        for k, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
            e.set_last_micro(k == 1)
            (t.stage(xm, pos, ym) / 1000.0).backward()
            launched.append(sum(b.launched for b in e.buckets))
        e.finish()
        out[overlap] = {"launched": launched, "buckets": len(e.buckets),
                        "all_done": all(b.launched and b.handle is None for b in e.buckets)}
    return out


def test_overlap_launches_during_last_backward_only(world2):
    r = world2["overlap"]
    assert r[True]["buckets"] > 2
    # nothing on the first micro-batch; on the last, every bucket started inside backward
    assert r[True]["launched"] == [0, r[True]["buckets"]]
    assert r[False]["launched"] == [0, 0]
    assert r[True]["all_done"] and r[False]["all_done"]


def _metrics_all_reduces(rank: int, world: int) -> dict:
    """The 1-element all-reduces one step of a dense model makes over dp2 (``metrics``), per
    ZeRO stage: the clip's Σg² over the shards (ZeRO ≥ 1) and the loss."""
    from fived.train.trainer import Trainer

    out = {}
    for zero in (0, 1, 3):
        t = Trainer(MODEL, ParallelConfig(dp=world, zero=zero), small_train(steps=1), rank,
                    world)
        t.step(0)
        out[zero] = t.traffic.records[("metrics", "all_reduce")].calls
        t.close()
    return out


def test_a_dense_model_sums_its_norm_in_the_loss_all_reduce(world2):
    """One 1-element-ish all-reduce a step at dp2, every ZeRO stage: the loss, with the clip's
    Σg² over the ZeRO shards riding in it (``Trainer.norm_rides_loss``). Mutations: the norm
    summed on its own (3 at ZeRO-1/3 with the empty expert group's too, 2 without); bit
    equality of the folded sums is ``test_zero_parity``'s (the same losses and gradients)."""
    for calls in world2["metrics_calls"]:
        assert calls == {0: 1, 1: 1, 3: 1}  # the loss, with the Σg² of the ZeRO shards in it
