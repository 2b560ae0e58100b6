"""bf16 parameters without the fp32 master (``--master-weights none|sr|kahan``): the rounding
primitives, the loss tracking the fp32-master run, and the ledger's master bytes (4Ψ -> 0 / 2Ψ)
equal to what the engine holds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.ledger.verify import compare_record
from fived.parallel.precision import stochastic_round_bf16, write_back
from fived.testing import small_train

SMALL = replace(preset("tiny"), layers=2, hidden=32, ffn=88, seq_len=32)


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way from 1 to the next bf16
    gen = torch.Generator().manual_seed(0)
    r = stochastic_round_bf16(x, gen).float()
    lo, hi = 1.0, 1.0 + 2**-7
    assert set(r.unique().tolist()) <= {lo, hi}
    assert abs(float(r.mean()) - float(x[0])) < 2e-5  # E[round(x)] = x
    assert abs(float((r == hi).float().mean()) - 0.125) < 0.005  # (x − lo) / ulp


def test_kahan_write_back_keeps_updates_round_to_nearest_loses():
    """10 000 updates of 1e-4 to a weight of 1.0 (half a bf16 ulp is 2⁻⁸ ≈ 3.9e-3): round to
    nearest loses every one, the compensated bf16 pair keeps their sum (to 2.6 %: c is bf16
    too, so each step rounds c at ~2⁻⁹·|c| — the pair carries about 16 bits, not 24)."""
    p_none = torch.ones(1, dtype=torch.bfloat16)
    p_k, comp = torch.ones(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
    lost = 0
    for _ in range(10_000):
        lost += int(write_back(p_none, p_none.float() + 1e-4, "none").sum())
        write_back(p_k, p_k.float() + comp.float() + 1e-4, "kahan", comp)
    assert float(p_none) == 1.0 and lost == 10_000
    assert abs(float(p_k) + float(comp) - 2.0) < 0.05


def test_master_weights_needs_bf16():
    with pytest.raises(ConfigError, match="master-weights"):
        validate(SMALL, ParallelConfig(master_weights="sr"), small_train())
    validate(SMALL, ParallelConfig(precision="bf16", master_weights="kahan"), small_train())


def _run(master: str, steps: int = 8):
    from fived.train.trainer import Trainer

    par = ParallelConfig(precision="bf16", master_weights=master)
    t = small_train(steps=steps, lr=1e-3, warmup=2)
    tr = Trainer(SMALL, par, t, 0, 1)
    tr.engine.measure_rounding = True
    losses, lost = [], []
    for s in range(steps):
        losses.append(tr.step(s)["loss"])
        lost.append(tr.engine.rounding["lost"] / max(1, tr.engine.rounding["moved"]))
    mem = {k: int(v) for k, v in tr.engine.memory().items()}
    bad = compare_record(SMALL, par, t.global_batch, {"memory_per_rank": [mem],
                                                      "traffic_per_rank": [{"bytes": {}}]})
    return losses, lost, mem, bad


def test_master_weights_track_fp32_and_ledger_counts_master_bytes():
    ref, lost_ref, mem_ref, bad = _run("fp32")
    assert not bad
    n = mem_ref["params"] // 2  # bf16 parameters
    assert mem_ref["master"] == 4 * n
    for mode, master_bytes in (("none", 0), ("sr", 0), ("kahan", 2 * n)):
        losses, lost, mem, bad = _run(mode)
        assert not bad, (mode, bad)
        assert mem["master"] == master_bytes, mode
        gap = max(abs(a - b) for a, b in zip(losses, ref))
        if mode != "none":
            assert gap < 0.01, (mode, gap, losses, ref)
        if mode == "none":
            assert max(lost) > 0.01, lost  # updates lost to rounding, measured
        if mode == "kahan":
            assert max(lost) < 1e-3, lost


def _experiment(name: str, tmp_path, *extra: str) -> dict:
    import json

    from fived.bench import numerics

    assert numerics.main([name, "--layers", "1", "--out", str(tmp_path), *extra]) == 0
    assert (tmp_path / f"numerics-{name}.png").stat().st_size > 1000
    return json.loads((tmp_path / f"numerics-{name}.json").read_text())["result"]


def test_experiment_reduce_bf16_error_grows_with_dp(tmp_path):
    r = _experiment("reduce", tmp_path)
    assert r["dp"] == [1, 2, 4, 8, 16]
    assert r["fp32"][0] == 0.0  # one shard: nothing summed
    assert all(f < 1e-6 < b for f, b in zip(r["fp32"], r["bf16"]))
    assert r["bf16"][-1] > r["bf16"][0]  # each hop rounds: the error grows with dp


@pytest.mark.slow
def test_experiment_fp16_scaler_trajectory_follows_its_rule(tmp_path):
    """The recorded scale halves after every step that overflowed (skipped) and only then,
    doubles after 5 clean steps; overflow counts are > 0 exactly on skipped steps."""
    r = _experiment("fp16", tmp_path, "--steps", "6")
    assert r["scale"][0] == 2.0 ** 24
    clean = 0
    for i in range(len(r["scale"]) - 1):
        assert (r["overflow"][i] > 0) == r["skipped"][i]
        clean = 0 if r["skipped"][i] else clean + 1
        want = r["scale"][i] / 2 if r["skipped"][i] else (
            r["scale"][i] * 2 if clean == 5 else r["scale"][i])
        clean = 0 if clean == 5 else clean
        assert r["scale"][i + 1] == want, (i, r["scale"])
    assert all(0 <= u <= 1 for u in r["underflow"])


@pytest.mark.slow
def test_experiment_masters_and_moments(tmp_path):
    r = _experiment("masters", tmp_path, "--steps", "4")
    assert r["fp32"]["master_bytes"] == 2 * r["kahan"]["master_bytes"] > 0
    assert r["none"]["master_bytes"] == r["sr"]["master_bytes"] == 0
    assert max(r["none"]["lost_fraction"]) > max(r["kahan"]["lost_fraction"])
    m = _experiment("moments", tmp_path, "--steps", "4")
    assert max(m["fp32"]["m_lost"]) == max(m["fp32"]["v_lost"]) == 0.0
    assert max(m["bf16"]["v_lost"]) > 0.0


def test_master_weights_under_zero_shards():
    """``--master-weights kahan|none`` with ZeRO-2 on 2 ranks: each member writes its shard
    back into bf16 and all-gathers it; the losses follow the one-rank run of the same mode and
    the ledger's bytes (master 2 or 0 bytes per owned element) are the engine's."""
    from fived.testing import rank_runs, run_ranks

    t = small_train(steps=3, lr=1e-3, warmup=2)
    for mode in ("kahan", "none"):
        one = _run(mode, steps=3)[0]
        par = ParallelConfig(precision="bf16", master_weights=mode, dp=2, zero=2)
        ranks = [r[0] for r in run_ranks(rank_runs, 2, [(SMALL, par, t)])]
        for s in ranks:
            assert max(abs(a - b) for a, b in zip(s["losses"], one)) < 2e-3, (mode, s["losses"])
        assert compare_record(SMALL, par, t.global_batch, ranks[0]["history"][-1]) == []


def test_fp8_bench_takes_its_statistics_at_the_steps_it_names(capsys):
    """`fived bench numerics fp8 --stats-every N`: the per-layer statistics come from the first
    step, every N-th and the last (the JSON's ``stats_steps``); the table's median step time
    leaves those steps out (they cast every watched tensor once more); a negative N is refused
    (exit 2, nothing run)."""
    from fived.bench.numerics import main, median_step, stats_steps

    assert stats_steps(300, 50) == [0, 50, 100, 150, 200, 250, 299]
    assert stats_steps(300, 0) == [0, 299] and stats_steps(1, 50) == [0]
    assert stats_steps(5, 2) == [0, 2, 4]
    assert median_step([9.0, 1.0, 2.0, 3.0, 9.0], [0, 4]) == 2.0
    assert median_step([9.0, 9.0], [0, 1]) == 9.0  # every step watched: all of them
    with pytest.raises(SystemExit) as e:
        main(["fp8", "--stats-every", "-1", "--out", "/nonexistent/never"])
    assert e.value.code == 2 and "--stats-every" in capsys.readouterr().err


def test_the_recorded_fp8_run_is_what_docs_numerics_says():
    """docs/figures/numerics-fp8.json (docs/numerics.md §5): `small` whole for 300 steps, bf16
    and each recipe on the same batches, statistics at steps 0, 50, …, 299; the table's numbers
    (the last 50 steps' mean gap, the worst layer's flushed x at the last step) are this JSON's,
    and the finer the scale the less of x is flushed."""
    import json
    import statistics
    from pathlib import Path

    d = json.loads((Path(__file__).parents[1] / "docs/figures/numerics-fp8.json").read_text())
    r = d["result"]
    assert (r["model"], r["layers"], r["global_batch"], r["seq_len"]) == ("small", 8, 8, 128)
    assert r["stats_steps"] == [0, 50, 100, 150, 200, 250, 299]
    ref = r["runs"]["none"]["loss"]
    assert len(ref) == 300 and round(ref[-1], 4) == 1.9575
    gap, flushed = {}, {}
    for k in ("tensorwise", "rowwise", "blockwise"):
        v = r["runs"][k]
        assert len(v["loss"]) == 300 and set(v["stats"]) == {str(s) for s in r["stats_steps"]}
        gap[k] = statistics.fmean(a - b for a, b in zip(v["loss"][-50:], ref[-50:]))
        last = v["stats"]["299"]
        assert len(last) == 56  # 8 blocks × 7 linears
        flushed[k] = max(layer["x"]["flushed"] for layer in last.values())
        assert max(layer[w]["saturated"] for layer in last.values() for w in "xwg") == 0
    assert [round(gap[k], 3) for k in gap] == [-0.024, -0.024, 0.039]
    assert flushed["tensorwise"] > flushed["rowwise"] > flushed["blockwise"]
    assert [round(flushed[k], 4) for k in flushed] == [0.0023, 0.0009, 0.0007]
