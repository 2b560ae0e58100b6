"""DDP and ZeRO-1/2/3: parity with one rank (fp32, 1e-5), model-state bytes and traffic per rank
equal to the ZeRO formulas exactly (plus the reported padding), overlap, and the pp guard."""

from __future__ import annotations

import pytest

from fived.config import ModelConfig, ParallelConfig, preset
from fived.testing import rel_diff, run_ranks, small_train, train_layout

MODEL = preset("tiny")
# odd sizes: every flat buffer needs padding to be split over 2 or 4 ranks
ODD = ModelConfig(name="odd", vocab=257, hidden=18, layers=2, heads=1, kv_heads=1, ffn=45,
                  seq_len=16)


@pytest.fixture(scope="module")
def reference():
    return train_layout(MODEL, ParallelConfig(), small_train())[0]


def _check_parity(reference, dp, zero, micro, **kw):
    par = ParallelConfig(dp=dp, zero=zero, micro_batches=micro, **kw)
    out = train_layout(MODEL, par, small_train())
    for s in out:
        assert len(s["losses"]) == 5
        assert rel_diff(s["losses"], reference["losses"]) < 1e-5, (par, s["losses"])
    assert reference["losses"][-1] < reference["losses"][0]
    return out


# a default subset touching every stage (dp 4: the slow matrix and the bytes test),
# accumulation on/off, small buckets
# (several buckets in flight), and --no-overlap
@pytest.mark.parametrize("dp,zero,micro,kw", [
    (2, 0, 2, {"bucket_mb": 0.05}),
    (2, 1, 1, {"bucket_mb": 0.1, "overlap": False}),
    (2, 2, 2, {"bucket_mb": 0.05}),
    (2, 3, 1, {}),
])
def test_zero_parity(reference, dp, zero, micro, kw):
    _check_parity(reference, dp, zero, micro, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("micro", [1, 2])
def test_zero_parity_matrix(reference, dp, zero, micro):
    _check_parity(reference, dp, zero, micro, bucket_mb=0.1)


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
        out.append({"case": (zero, precision, grad_dtype), "psi": psi, "memory": mem,
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
                ag = (2 if zero == 3 else 1) * f * full_params
                assert tr["all_gather"]["bytes"] == pytest.approx(ag, rel=1e-12)
                if zero == 3 and full_grads == full_params:  # 3(N−1)/N · param bytes
                    total = tr["reduce_scatter"]["bytes"] + tr["all_gather"]["bytes"]
                    assert total == pytest.approx(3 * f * full_params, rel=1e-12)
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


def test_overlap_launches_during_last_backward_only():
    r = run_ranks(_overlap_probe, 2)[0]
    assert r[True]["buckets"] > 2
    # nothing on the first micro-batch; on the last, every bucket started inside backward
    assert r[True]["launched"] == [0, r[True]["buckets"]]
    assert r[False]["launched"] == [0, 0]
    assert r[True]["all_done"] and r[False]["all_done"]
