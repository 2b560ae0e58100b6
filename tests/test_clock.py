"""The roofline clock (fived.ledger.roofline), GPT-style shapes, the calibration table and the
planner's use of the clock."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from dataclasses import replace

import pytest

from fived.config import PRESETS, ConfigError, ModelConfig, ParallelConfig, check_runtime_model
from fived.ledger import hardware, params, planner, roofline, validate

HW = hardware.PRESETS["h100-sxm"]


def gpt(h: int, layers: int, heads: int, vocab: int = 51200, seq: int = 2048, tied=True):
    return ModelConfig(name="gpt", vocab=vocab, hidden=h, layers=layers, heads=heads,
                       kv_heads=heads, ffn=4 * h, seq_len=seq, mlp="gelu", positions="learned",
                       norm="layernorm", bias=True, tied_embeddings=tied)


@pytest.mark.parametrize("h,layers", [(2304, 24), (25600, 128), (12288, 96)])
def test_gpt_parameter_count_is_megatrons(h, layers):
    # Narayanan et al. 2021: P = 12·l·h² + 13·l·h + (V + s)·h (+ the final LayerNorm's 2h)
    m = gpt(h, layers, h // 128)
    assert params.total_params(m) == 12 * layers * h * h + 13 * layers * h + (51200 + 2048) * h + 2 * h


def test_gqa_and_swiglu_counts_unchanged():
    assert params.total_params(PRESETS["llama3-8b"]) == 8_030_261_248


def test_runtime_refuses_gpt_shapes_and_names_the_flag():
    check_runtime_model(PRESETS["small"])
    with pytest.raises(ConfigError) as e:
        check_runtime_model(replace(PRESETS["small"], mlp="gelu", bias=True))
    text = str(e.value)
    assert "--mlp gelu" in text and "--bias" in text
    r = subprocess.run([sys.executable, "-m", "fived", "train", "--mlp", "gelu", "--steps", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "ConfigError" in r.stderr and "Traceback" not in r.stderr


def test_gemm_efficiency_grows_with_every_dimension():
    small, big = roofline.gemm_efficiency(HW, 512, 512, 512), roofline.gemm_efficiency(HW, 8192, 8192, 8192)
    assert small < big < HW.gemm_eff
    assert roofline.gemm_efficiency(HW, 8192, 64, 8192) < roofline.gemm_efficiency(HW, 8192, 1024, 8192)


def test_op_time_is_the_roofline_max():
    e = 2
    square = roofline._gemm("sq", 8192, 8192, 8192, e)  # compute-bound
    t = roofline.op_seconds(square, HW, "bf16") - HW.overhead
    assert t == pytest.approx(square.flops / (HW.peak_flops * roofline.gemm_efficiency(HW, *square.dims)))
    skinny = roofline._gemm("gemv", 1, 8192, 8192, e)  # memory-bound: the weight read dominates
    t = roofline.op_seconds(skinny, HW, "bf16") - HW.overhead
    assert t == pytest.approx(skinny.bytes / (HW.hbm_bw * HW.mem_eff))


def test_block_flops_match_the_ledger_convention():
    # the roofline's GEMMs of one block are exactly 2·block_matmul_params FLOPs per token
    m = PRESETS["llama3-8b"]
    par = ParallelConfig(precision="bf16")
    ops = roofline.block_ops(m, par, 1, roofline.ClockOptions())
    gemm = sum(o.flops for o in ops["fwd"] if o.kind == "gemm")
    assert gemm == pytest.approx(2 * params.block_matmul_params(m) * m.seq_len)
    bwd = sum(o.flops for o in ops["bwd"] if o.kind == "gemm")
    assert bwd == pytest.approx(2 * gemm)
    attn = sum(o.flops for o in ops["fwd"] if o.kind == "attn")
    assert attn == pytest.approx(4 * m.seq_len * m.seq_len * m.hidden / 2)  # causal halved


def test_fused_gemms_keep_flops_and_unfused_loss_moves_more_bytes():
    m = replace(PRESETS["llama3-8b"], seq_len=1024)
    par = ParallelConfig(tp=2, sequence_parallel=True, precision="bf16")
    sep = roofline.block_ops(m, par, 1, roofline.ClockOptions())["fwd"]
    fus = roofline.block_ops(m, par, 1, roofline.ClockOptions(fused_gemm=True))["fwd"]
    flops = [sum(o.flops for o in ops if o.kind == "gemm") for ops in (sep, fus)]
    assert flops[0] == pytest.approx(flops[1])
    assert {o.name for o in fus} >= {"qkv", "mlp.gate_up"} and "q" not in {o.name for o in fus}
    fused = roofline.stage_extra_ops(m, par, 1, False, True, roofline.ClockOptions())
    eager = roofline.stage_extra_ops(m, par, 1, False, True, roofline.ClockOptions(fused_loss=False))
    loss = [next(o for o in x["fwd"] if o.name == "loss") for x in (fused, eager)]
    t, v = 1024, m.vocab / 2
    assert loss[0].bytes == t * v * 6 and loss[1].bytes == t * v * (2 + 36)
    assert loss[1].count == 6


def test_tp_cuts_the_gemms_and_recompute_adds_a_forward():
    m = PRESETS["llama3-8b"]
    base = ParallelConfig(precision="bf16")
    one = roofline.micro_batch_times(m, base, 1, HW, 4, False, False)
    tp4 = roofline.micro_batch_times(m, replace(base, tp=4, sequence_parallel=True), 1, HW, 4, False,
                              False)
    assert tp4["fwd"] < one["fwd"] / 3  # about a quarter, smaller GEMMs a bit less efficient
    full = roofline.micro_batch_times(m, replace(base, recompute="full"), 1, HW, 4, False, False)
    assert full["recompute"] == pytest.approx(full["fwd"])
    sel = roofline.micro_batch_times(m, replace(base, recompute="selective"), 1, HW, 4, False, False)
    assert 0 < sel["recompute"] < full["recompute"]


def test_prediction_components_add_up_and_mfu_below_ceiling():
    m = PRESETS["llama3-70b"]
    par = ParallelConfig(tp=8, pp=4, dp=2, schedule="interleaved", virtual_stages=2,
                         micro_batches=16, sequence_parallel=True, zero=1, precision="bf16")
    pr = planner.predict(m, par, HW, 32)
    assert sum(pr.times.values()) == pytest.approx(pr.step_seconds)
    assert 0.2 < pr.mfu < HW.gemm_eff
    flat = planner.predict(m, par, HW, 32, efficiency=0.7)  # the old clock on request
    assert flat.step_seconds != pr.step_seconds


def test_nccl_uses_every_nic_of_the_group_on_a_node():
    par = ParallelConfig(tp=2, dp=8)  # dp ranks 0,2,4,6 on node 0 of 4 GPUs
    bw, _, kind = planner.link(HW, par, "dense", 4)
    assert kind == "inter" and bw == pytest.approx(2 * HW.inter_bw)
    assert planner.ranks_per_node(ParallelConfig(tp=8, dp=4), "dp", 8) == 1


def test_runs_table_has_a_source_for_every_row():
    with open(validate.RUNS, "rb") as f:
        data = tomllib.load(f)
    for fam in data["family"].values():
        assert len(fam["source"]) > 80
    runs = validate.load()
    assert len(runs) >= 18
    for r in runs:
        assert r.family in data["family"] and r.par.world_size == r.gpus


@pytest.mark.slow
def test_validate_reports_the_fit_honestly():
    checks = validate.check_all([r for r in validate.load() if r.par.fp8 == "none"])
    s = validate.summary(checks)
    # the targets: median <= 3 points, worst <= 8. The median is met (2.5); the worst is not:
    # 9.2 (mcore-32b, whose fp32 reduce-scatter on one NIC per rank cannot hide behind one
    # micro-batch's backward; docs/ledger.md). The bound is what is true, not the target.
    assert s["median_abs_error_points"] <= 3.0
    assert s["worst_abs_error_points"] <= 9.5
    # the published tokens/s follow from the source's own FLOP convention
    c = next(c for c in checks if c.run.name == "mcore-1.7b")
    assert c.run.tflops_per_gpu / 989 == pytest.approx(c.run.mfu, abs=0.005)


def test_published_fp8_rows_are_checked_not_fitted():
    """Megatron-Bridge's H100 FP8-CS rows (docs/ledger.md): loaded with --fp8 tensorwise and
    their published layouts, the ratio from the published tokens/s. The clock prices their
    linears at the fp8 peak (2× bf16) and no cast: it over-predicts, more with size. The bounds
    are what is true today, not a target; refitting leaves these rows out."""
    runs = [r for r in validate.load() if r.par.fp8 != "none"]
    assert [r.name for r in runs] == ["mbridge-llama3-8b-fp8", "mbridge-llama3-70b-fp8",
                                      "mbridge-llama31-405b-fp8"]
    assert all(r.par.fp8 == "tensorwise" and r.wps > 0 for r in runs)
    assert [(r.par.tp, r.par.pp, r.par.cp, r.par.virtual_stages, r.par.dp, r.par.zero)
            for r in runs] == [(1, 1, 1, 1, 8, 3), (4, 8, 1, 5, 2, 1), (8, 8, 2, 8, 8, 1)]
    ratios = []
    for r in runs:
        c = validate.check(r)
        bf16 = validate.check(replace(r, par=replace(r.par, fp8="none")))
        assert c.mfu_pred == pytest.approx(r.mfu * c.ratio)
        # fp8 predicted faster than the same layout in bf16, and the published run lies between
        assert bf16.ratio < 1.0 < c.ratio
        ratios.append(c.ratio)
    assert 1.0 < ratios[0] < 1.1 and 1.1 < ratios[1] < 1.2 and 1.25 < ratios[2] < 1.35
    assert all(r.par.fp8 == "none" for r in validate.load() if r.family in validate.FITTED_ON)


def test_ledger_validate_cli_prints_and_writes_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fived", "ledger", "--validate", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    fp8 = [row for row in doc["runs"] if row["fp8"] != "none"]
    assert doc["summary"]["runs"] == len(doc["runs"]) - len(fp8) >= 18  # bf16/fp16 rows
    assert doc["summary_fp8"]["runs"] == len(fp8) == 3
    assert all(row["source"] for row in doc["runs"])


def test_plan_shows_where_the_time_goes():
    r = subprocess.run([sys.executable, "-m", "fived", "plan", "--model", "llama2-7b", "--gpus",
                        "8", "--precision", "bf16", "--top", "3", "--schedules", "1f1b",
                        "--micro-batch-sizes", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "where the time goes" in r.stdout and "bubble" in r.stdout
