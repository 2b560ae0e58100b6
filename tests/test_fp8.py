"""fp8 linear layers (``fived.model.fp8``, ``fived.parallel.fp8``): the casts' numerics, the
products against the dequantised operands, a one-rank run per recipe, and every layout equal to
the one-rank fp8 run of the same recipe.

Every scale is a power of 2 (``fived.model.fp8``): with s = amax / fmax instead, tp2
tensorwise's first-step gradients were 1e-2 from one rank's and tp2 blockwise's 6e-3 (an amax
differing in its last bit re-rounds single elements); with power-of-2 scales every layout below
is within 1.3e-7.

Parity is at ``--precision fp32`` with ``--fp8`` (the products fp8, everything around them
fp32), so rounding of the compute dtype does not hide a difference: losses of every step and
every parameter's gathered first-step gradient within 1e-5 relative. The reference is the
one-rank fp8 run whose micro-batches are the layout's per-rank micro-batches (a token-cut
layout, dp, casts each rank's tokens together, as torchtitan does: tensorwise scales, rowwise's
wgrad scales and blockwise's token tiles span the micro-batch). tp cuts features: the amax is
max-reduced over tp (``fived.parallel.fp8``), so tp equals one rank; blockwise under tp needs
shard widths that are whole 128-tiles (``MODEL_128``).

Mutations seen to fail (each restored): the clamp before the fp8 cast removed
(``test_saturation_clamps_instead_of_nan``: NaN); the amax all-reduce over tp removed
(``test_tp_cut_layers_cast_with_one_ranks_scales[tensorwise]``: dW of the column layer 5e-2
away; the whole-model tp2 parity alone did not see it: with power-of-2 scales a shard's own
scale changes no rounding unless values turn subnormal); the K tiles' scales taken in reverse
order in ``scaled_matmul`` (``test_products_equal_the_dequantised_operands[blockwise]``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, TrainConfig, preset, validate
from fived.model import fp8 as fp8_mod
from fived.model.fp8 import E4M3, E5M2, FMAX, RECIPES, Fp8Linear

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, fp8_reference, train_runs  # noqa: E402,I001

TINY = replace(preset("tiny"), layers=2, seq_len=16)
# every tp=2 shard a whole 128-wide tile: q, kv heads 4·64 / 2, ffn 256 / 2
MODEL_128 = replace(TINY, hidden=256, heads=4, kv_heads=4, ffn=256)
TRAIN = TrainConfig(steps=3, global_batch=4, lr=3e-3, warmup=1, seed=7)


# ------------------------------------------------------------------ the casts
def test_quantize_round_trip_and_amax_per_tile():
    """e4m3 keeps 3 mantissa bits: a normal value comes back within 2⁻⁴ relative; each tile's
    scale is its own amax / 448, a short last tile (200 = 128 + 72) included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 200, generator=g)
    x[3, 150] = 40.0  # the amax of tile (3, 1) only
    q = fp8_mod.quantize(x, E4M3, (1, 128))
    assert q.scale.shape == (8, 2)
    manual = torch.stack([x[:, :128].abs().amax(1), x[:, 128:].abs().amax(1)], 1) / 448
    torch.testing.assert_close(q.scale, manual, rtol=0, atol=0)
    back = fp8_mod.dequantize(q)
    s = fp8_mod.expand(q.scale, q.tile, (8, 200))
    normal = (x / s).abs() >= 2.0 ** -6
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2.0 ** -4 + 1e-12).all()
    assert back[3, 150] == 40.0  # the amax maps to 448 exactly
    # tensorwise: one scale; rowwise: one per row; every recipe's scales powers of 2
    assert fp8_mod.quantize(x, E4M3, (None, None)).scale.shape == (1, 1)
    assert fp8_mod.cast(x, "rowwise", "x_fwd").scale.shape == (8, 1)
    for recipe in RECIPES:
        r = fp8_mod.cast(x, recipe, "x_fwd")
        assert torch.equal(torch.log2(r.scale), torch.log2(r.scale).round())
        assert (r.data.float().abs().amax() > FMAX[E4M3] / 2)  # at most one bit of range lost


def test_saturation_clamps_instead_of_nan():
    """An amax below the values (a scale from elsewhere, as a reduction or a delayed scale
    would give) saturates at ±fmax: e4m3fn has no infinity, an unclamped cast is NaN."""
    x = torch.tensor([[1.0, -3.0, 0.5, 2.0]])
    q = fp8_mod.quantize(x, E4M3, (None, None), reduce=lambda a: a.mul_(0.25))  # s = 0.75/448
    assert not torch.isnan(q.data.float()).any()
    assert q.data.float()[0, 1] == -FMAX[E4M3] and q.data.float()[0, 3] == FMAX[E4M3]
    g = fp8_mod.quantize(x * 1e4, E5M2, (None, None), reduce=lambda a: a.mul_(1e-3))
    assert g.data.float().abs().max() == FMAX[E5M2]


def test_flush_to_zero_below_half_the_smallest_subnormal():
    """A value below half e4m3's smallest subnormal (2⁻⁹) times the scale becomes 0; one just
    above it survives as a subnormal."""
    amax = 448.0  # s = 1
    x = torch.tensor([[amax, 2.0 ** -11, 2.0 ** -9, 0.0]])
    q = fp8_mod.quantize(x, E4M3, (None, None))
    assert q.scale.item() == 1.0
    assert q.data.float().tolist() == [[448.0, 0.0, 2.0 ** -9, 0.0]]


@pytest.mark.parametrize("recipe", RECIPES)
def test_products_equal_the_dequantised_operands(recipe):
    """Forward, dgrad and wgrad of ``fp8_linear`` equal float64 products of the dequantised
    casts each recipe prescribes (the fp32 accumulation's rounding only), K = 200 (a short
    tile) and a token count (48) that is no multiple of 128."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, 200, generator=g).requires_grad_()
    w = (torch.randn(96, 200, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(3, 16, 96, generator=g)
    y = fp8_mod.fp8_linear(x, w, recipe)
    y.backward(dy)
    x2, g2 = x.detach().reshape(-1, 200), dy.reshape(-1, 96)

    def deq(t, role):
        return fp8_mod.dequantize(fp8_mod.cast(t, recipe, role)).double()

    ref_y = deq(x2, "x_fwd") @ deq(w.detach().t(), "w_fwd")
    xw = x2 if recipe != "blockwise" else fp8_mod.dequantize(fp8_mod.cast(x2, recipe, "x_fwd"))
    ref_dx = deq(g2, "g_dgrad") @ deq(w.detach(), "w_dgrad")
    ref_dw = deq(g2.t(), "g_wgrad") @ deq(xw, "x_wgrad")
    for got, ref in ((y.reshape(-1, 96), ref_y), (x.grad.reshape(-1, 200), ref_dx),
                     (w.grad, ref_dw)):
        assert ((got.double() - ref).norm() / ref.norm()) < 1e-6
    # and fp8 is not exact: the product is ~e4m3's rounding away from the fp32 one
    exact = x2.double() @ w.detach().double().t()
    gap = float((y.detach().reshape(-1, 96).double() - exact).norm() / exact.norm())
    assert 1e-3 < gap < 0.1, gap
    # the formats: tensorwise's gradient is e5m2, the others' e4m3
    assert fp8_mod.role(recipe, "g_dgrad")[0] == (E5M2 if recipe == "tensorwise" else E4M3)


def test_blockwise_weight_blocks_serve_both_products():
    """The 128×128 weight blocks of Wᵀ (forward) and W (dgrad) are the same blocks: the same
    fp8 values, transposed, so the backward's recast of the parameter reproduces forward's."""
    w = torch.randn(256, 384)
    a = fp8_mod.cast(w.t(), "blockwise", "w_fwd")
    b = fp8_mod.cast(w, "blockwise", "w_dgrad")
    assert torch.equal(a.data.t().float(), b.data.float())
    assert torch.equal(a.scale.t(), b.scale)


def test_saved_bytes_per_input_element():
    """What the fp8 linear saves of its input x, per element: 1 byte (tensorwise, and its one
    fp32 scale), 1 + 4 per 128-tile (blockwise), the compute dtype (rowwise); the weight is the
    parameter itself."""
    assert fp8_mod.saved_bytes_per_element("tensorwise", 2, 256) == 1.0
    assert fp8_mod.saved_bytes_per_element("blockwise", 2, 256) == 1.0 + 8 / 256
    assert fp8_mod.saved_bytes_per_element("rowwise", 2, 256) == 2.0
    lin = torch.nn.Linear(256, 64, bias=False)
    x = torch.randn(32, 256, requires_grad=True)
    for recipe, whole in (("tensorwise", 4), ("blockwise", 0), ("rowwise", 0)):
        y = fp8_mod.fp8_linear(x, lin.weight, recipe)
        saved = [t for t in y.grad_fn.saved_tensors if t is not lin.weight]
        assert sum(t.numel() * t.element_size() for t in saved) == \
            x.numel() * fp8_mod.saved_bytes_per_element(recipe, 4, 256) + whole
        assert saved[0].dtype == (torch.float32 if recipe == "rowwise" else E4M3)


# ------------------------------------------------------------------ the model
def test_one_rank_each_recipe_trains_close_to_bf16():
    """--precision bf16: each recipe's losses within 1 % of the bf16 run's over 3 steps; the
    attention and MLP linears are fp8, the embedding, head and norms are not."""
    from fived.train.trainer import Trainer

    losses = {}
    for recipe in ("none", *RECIPES):
        tr = Trainer(TINY, ParallelConfig(precision="bf16", fp8=recipe), TRAIN, 0, 1)
        losses[recipe] = [tr.step(s)["loss"] for s in range(TRAIN.steps)]
        fp8_names = {n for n, m in tr.stage.named_modules() if isinstance(m, Fp8Linear)}
        tr.close()
        if recipe != "none":
            assert len(fp8_names) == 7 * TINY.layers
            assert not any("embed" in n or "head" in n for n in fp8_names)
    for recipe in RECIPES:
        gap = max(abs(a - b) / b for a, b in zip(losses[recipe], losses["none"]))
        assert 0 < gap < 1e-2, (recipe, gap)


def test_bad_fp8_layouts_are_config_errors():
    """fp16 around fp8 is refused; blockwise under tp needs whole 128-tiles per shard."""
    with pytest.raises(ConfigError, match="--fp8 tensorwise"):
        validate(TINY, ParallelConfig(precision="fp16", fp8="tensorwise"))
    with pytest.raises(ConfigError, match="straddle the tp cut"):
        validate(TINY, ParallelConfig(tp=2, precision="fp32", fp8="blockwise"))
    validate(MODEL_128, ParallelConfig(tp=2, precision="fp32", fp8="blockwise"))
    validate(TINY, ParallelConfig(precision="fp32", fp8="blockwise"))  # pads, one rank


def _tp_pair(rank: int, world: int, recipe: str, sp: bool) -> dict:
    """A column layer (q_proj) then a row layer (o_proj) cut over tp and swapped to fp8 by
    ``apply_fp8``, with weights whose halves differ 2¹² in magnitude, against the one-rank fp8
    pair. (Power-of-2 scales change no rounding of a normal value; a shard's own smaller amax
    would keep normal what the whole matrix's scale makes subnormal: the halves differ enough
    that about 40 % of the small half is subnormal under the whole's scale.)"""
    from torch import nn

    from fived.comm.ops import Traffic
    from fived.parallel.fp8 import apply_fp8
    from fived.parallel.tensor import ColumnLinear, Columns, RowLinear
    from fived.ranks.grid import Grid

    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(Traffic())
    tp = grid["tp"]
    g = torch.Generator().manual_seed(5)
    wq, wo = torch.randn(64, 64, generator=g) * 0.05, torch.randn(64, 64, generator=g) * 0.05
    wq[32:] *= 2 ** 12
    wo[:, 32:] *= 2 ** 12
    x = torch.randn(2, 8, 64, generator=g)
    dy = torch.randn(2, 8, 64, generator=g)
    # one rank
    xr, q, o = x.clone().requires_grad_(), wq.clone().requires_grad_(), wo.clone().requires_grad_()
    ref = fp8_mod.fp8_linear(fp8_mod.fp8_linear(xr, q, recipe), o, recipe)
    ref.backward(dy)
    # tp: the same model cut, the fp8 products applied by name
    attn = nn.Module()
    attn.q_proj = ColumnLinear(wq, tp, Columns(tp, sp, False), world)
    attn.o_proj = RowLinear(wo, tp, sp)
    root = nn.Module()
    root.layers = nn.ModuleDict({"0": nn.Module()})
    root.layers["0"].self_attn = attn
    apply_fp8(root, tp, recipe)
    xs = x.chunk(world, 1)[rank] if sp else x
    xt = xs.clone().requires_grad_()
    y = attn.o_proj(attn.q_proj(xt))
    y.backward(dy.chunk(world, 1)[rank] if sp else dy)
    want_y = ref.detach().chunk(world, 1)[rank] if sp else ref.detach()
    want_dx = xr.grad.chunk(world, 1)[rank] if sp else xr.grad
    def rel(a, b):
        return float((a - b).norm() / b.norm())
    return {"y": rel(y.detach(), want_y), "dx": rel(xt.grad, want_dx),
            "dwq": rel(attn.q_proj.weight.grad, q.grad.chunk(world, 0)[rank]),
            "dwo": rel(attn.o_proj.weight.grad, o.grad.chunk(world, 1)[rank])}


@pytest.mark.parametrize("recipe,sp", [("tensorwise", False), ("rowwise", True)])
def test_tp_cut_layers_cast_with_one_ranks_scales(recipe, sp):
    """The amax max-reduced over tp: forward, dx and both weight gradients of a cut
    column/row pair equal the one-rank fp8 pair's to fp32 rounding, with shards whose own
    amax would give other scales (without the reduction: errors of a whole fp8 step)."""
    from fived.testing import run_ranks

    for r in run_ranks(_tp_pair, 2, recipe, sp):
        for k in ("y", "dx", "dwq", "dwo"):
            assert r[k] < 1e-5, (recipe, k, r)


# (model, layout, the reference's micro-batches)
FAST = [
    (TINY, ParallelConfig(tp=2, precision="fp32", fp8="tensorwise"), 1),
    (TINY, ParallelConfig(tp=2, sequence_parallel=True, precision="fp32", fp8="rowwise"), 1),
]
SLOW = [
    (MODEL_128, ParallelConfig(tp=2, sequence_parallel=True, precision="fp32", fp8="blockwise"),
     1),
    (TINY, ParallelConfig(dp=2, zero=3, precision="fp32", fp8="blockwise"), 2),
    (TINY, ParallelConfig(pp=2, micro_batches=2, precision="fp32", fp8="tensorwise"), 2),
    (TINY, ParallelConfig(dp=2, recompute="full", precision="fp32", fp8="rowwise"), 2),
    (replace(preset("tiny-moe"), layers=2, seq_len=16),
     ParallelConfig(ep=2, precision="fp32", fp8="tensorwise"), 2),
]


def _layouts_equal_one_rank(layouts):
    outs = train_runs([(m, p, TRAIN) for m, p, _ in layouts])
    for (m, p, micro), out in zip(layouts, outs):
        check_parity(out, fp8_reference(m, p.fp8, micro, TRAIN), p.describe())


def test_tp_layouts_equal_one_rank():
    """tp2 (tensorwise: every amax max-reduced over tp) and tp2+SP (rowwise: the scales along
    a cut dimension reduced), one spawn, against the one-rank fp8 run of the recipe.
    Time: two 2-rank runs and two in-process references; 3.3 s on a quieter machine, 37–46 s
    measured under load with the pool's first start."""
    _layouts_equal_one_rank(FAST)


@pytest.mark.slow
def test_every_layout_equals_one_rank():
    """tp2+SP blockwise on whole tiles, dp2 ZeRO-3 (blockwise), pp2 (tensorwise), dp2 with
    full recompute (rowwise), ep2 of a MoE model (tensorwise; the experts a loop of fp8
    linears), each against the one-rank fp8 run of its recipe and per-rank micro-batches."""
    _layouts_equal_one_rank(SLOW)


def test_linears_reading_one_tensor_share_its_fp8_cast():
    """q, k and v read the same normalised input: one fp8 copy of it is saved (measured by the
    saved-tensor hooks), not three; an input changed in place is cast again."""
    from fived.train.activations import SavedTensors

    x = torch.randn(64, 256, requires_grad=True)
    ws = [torch.nn.Parameter(torch.randn(32, 256) * 0.05) for _ in range(3)]
    with SavedTensors() as s:
        n = x * 1.0  # the norm output, not itself saved by the fp8 linears
        ys = [fp8_mod.fp8_linear(n, w, "tensorwise") for w in ws]
    fp8_bytes = s.by_dtype[str(E4M3)]
    assert fp8_bytes == 64 * 256, s.sizes
    sum(y.sum() for y in ys).backward()
    with torch.no_grad():
        a = fp8_mod.fp8_linear(n.detach(), ws[0], "tensorwise")
        m = n.detach()
        m2 = m * 1.0
        b1 = fp8_mod.fp8_linear(m2, ws[0], "tensorwise")
        m2.mul_(2.0)
        b2 = fp8_mod.fp8_linear(m2, ws[0], "tensorwise")
    assert torch.equal(b2, 2 * b1) and torch.equal(a, b1)


def _saved_and_ledger(fp8: str, name: str = "tiny") -> tuple[int, float]:
    from fived.comm.ops import Traffic
    from fived.ledger import memory
    from fived.model import build_model
    from fived.parallel.parallelize import parallelize_parts
    from fived.ranks.grid import Grid
    from fived.train.activations import SavedTensors

    m = preset(name)
    par = ParallelConfig(fp8=fp8, precision="fp32")
    grid = Grid.from_config(par).connect(Traffic())
    (model,), _ = parallelize_parts(build_model(m, 1), grid, par)
    x = torch.randint(0, m.vocab, (2, m.seq_len))
    with SavedTensors(list(model.parameters())) as s:
        model(x, torch.arange(m.seq_len), x)
    return s.bytes, sum(memory.activations(m, par, 2).values())


@pytest.mark.parametrize("recipe", RECIPES)
def test_ledger_counts_the_fp8_saves_to_the_byte(recipe):
    """One rank, tiny (ffn 176: blockwise's down projection has a short tile): what autograd
    saves with --fp8 against the ledger's activations moves by exactly what it moves without
    fp8 (the ledger's known 1,120-byte gap of this model, the loss scalar and the like): the fp8
    copies, their scales and the bf16 saves they replace are counted to the byte."""
    saved, ledger = _saved_and_ledger(recipe)
    base_saved, base_ledger = _saved_and_ledger("none")
    assert ledger - saved == base_ledger - base_saved
    assert (saved < base_saved) == (recipe != "rowwise")


@pytest.mark.parametrize("recipe", RECIPES)
def test_ledger_counts_the_moe_experts_fp8_saves_to_the_byte(recipe):
    """One rank, tiny-moe (4 experts, top-2, every block MoE): the experts as a loop of fp8
    linears save their routed rows and their SwiGLU products as fp8 copies with scales
    (tensorwise one per copy and expert; blockwise per 128-tile of each row) in place of the
    permuted rows and the products; the ledger moves by exactly what autograd's saves move."""
    saved, ledger = _saved_and_ledger(recipe, "tiny-moe")
    base_saved, base_ledger = _saved_and_ledger("none", "tiny-moe")
    assert ledger - saved == base_ledger - base_saved
    assert (saved < base_saved) == (recipe != "rowwise")


@pytest.mark.slow
def test_dry_run_of_fp8_moe_ep2_activations_are_exact(tmp_path):
    """`fived train --dry-run --model tiny-moe --fp8 blockwise --ep 2 --dp 2 --zero 3` then
    `fived ledger --check`: every rank's traffic and model states exact (the experts' own fp8
    weights ride the bf16 gather: blockwise), the activation peak within the check's
    tolerance (the experts' fp8 saves at ep2, uniform routing)."""
    from parity_helpers import dry_run_is_exact

    c = dry_run_is_exact(tmp_path, "--model", "tiny-moe", "--fp8", "blockwise", "--precision",
                         "bf16", "--ep", "2", "--dp", "2", "--zero", "3")
    text = " ".join(c.stdout.split())
    assert "activation peak" not in text.split("dry run:")[0], c.stdout  # no mismatch line


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_dry_run_step_peak_of_fp8_zero3_is_the_ledgers(tmp_path, recipe):
    """`fived train --dry-run --model small --fp8 R --dp 4 --zero 3` (with the fp8 gather) then
    `fived ledger --check`: the step peak, at the first block's backward with its ZeRO-3
    buffers, within the check's 0.5 % (+0.03 % each). Mutations: without the down projection's
    input counted as the fp8 copy its backward freed (``peak.block_backward_bytes``) tensorwise
    is −0.72 %; without the gather's scales held through the step (the replay's ``sbytes``,
    4·(N + K) bytes per rowwise weight) rowwise was −0.26 %."""
    _step_peak_is_the_ledgers(tmp_path, "--dp", "4", "--zero", "3", "--fp8", recipe,
                              "--ranks", "0")


def test_dry_run_step_peak_of_blockwise_is_the_ledgers(tmp_path):
    """`fived train --dry-run --model small --seq-len 32 --fp8 blockwise` then `fived ledger
    --check`: the traced step peak within the check's 0.5 % of the ledger's. The casts divide
    in the input's dtype with the tile scales broadcast (``fived.model.fp8.quantize``), so their
    working set stays under the loss's moment; with x.float() and the scales expanded to an
    fp32 matrix (12 bytes per element of w_down's input) the forward's last block peaked 0.73 %
    above the ledger (−1.85 % at seq 128)."""
    _step_peak_is_the_ledgers(tmp_path, "--seq-len", "32", "--global-batch", "4", "--dp", "1",
                              "--fp8", "blockwise")


def _step_peak_is_the_ledgers(tmp_path, *flags: str) -> None:
    """`fived train --dry-run --model small --precision bf16 --steps 1 FLAGS`, then `fived
    ledger --check`: no rank's traced step peak outside the check's 0.5 % of the ledger's."""
    from parity_helpers import run_cli

    out = tmp_path / "run.jsonl"
    r = run_cli("train", "--dry-run", "--model", "small", "--precision", "bf16", "--steps", "1",
                *flags, "--metrics-out", str(out))
    assert r.returncode == 0, r.stderr
    c = run_cli("ledger", "--check", str(out))
    assert "step peak:" not in c.stdout and "step peak per rank" in c.stdout, c.stdout


def test_the_clock_runs_the_fp8_linears_at_the_fp8_peak():
    """H100: fp8 dense peak 2× bf16: with --fp8 the linears' GEMMs (forward and both backward
    products) take half the compute-bound time, the attention core and the head do not change;
    a device without an fp8 peak (A100) runs them at its bf16 peak."""
    from fived.ledger.hardware import PRESETS as HARDWARE
    from fived.ledger.roofline import ClockOptions, block_ops, op_seconds

    m = preset("llama3-8b")
    h100, a100 = HARDWARE["h100-sxm"], HARDWARE["a100-80gb"]
    assert h100.matmul_peak("fp8") == pytest.approx(2 * h100.matmul_peak("bf16"), rel=1e-3)
    assert a100.matmul_peak("fp8") == a100.matmul_peak("bf16")
    bf, f8 = (block_ops(m, ParallelConfig(tp=8, precision="bf16", fp8=r), 1, ClockOptions())
              for r in ("none", "tensorwise"))
    for key in ("fwd", "bwd"):
        linears = [o for o in f8[key] if o.fp8]
        assert len(linears) == (7 if key == "fwd" else 14)
        saved = 0.0
        for a, b in zip(bf[key], f8[key]):
            ta, tb = op_seconds(a, h100, "bf16"), op_seconds(b, h100, "bf16")
            assert (tb <= ta) if b.fp8 else (tb == ta), (a.name, ta, tb)
            saved += ta - tb
            assert op_seconds(b, a100, "bf16") == op_seconds(a, a100, "bf16")
        linear_time = sum(op_seconds(a, h100, "bf16") for a, b in zip(bf[key], f8[key]) if b.fp8)
        assert 0.3 * linear_time < saved <= 0.5 * linear_time + 1e-12  # at most the 2× peak


def test_bench_numerics_fp8_writes_its_runs(tmp_path):
    """`fived bench numerics fp8` at its smallest: the JSON holds bf16 and every recipe over the
    same steps, the per-layer cast statistics of the first and last step (every fp8 linear, its
    input, weight and output gradient), the outlier experiment, and the PNG."""
    import json

    from fived.bench.numerics import main

    assert main(["fp8", "--steps", "2", "--layers", "1", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "numerics-fp8.json").read_text())["result"]
    assert set(d["runs"]) == {"none", *RECIPES} and d["stats_steps"] == [0, 1]
    for recipe in RECIPES:
        st = d["runs"][recipe]["stats"]
        assert set(st) == {"0", "1"} and len(st["1"]) == 7  # one block's seven linears
        for layer in st["1"].values():
            assert set(layer) == {"x", "w", "g"}
            assert all(v["saturated"] == 0 and 0 <= v["flushed"] < 0.01 for v in layer.values())
    assert (tmp_path / "numerics-fp8.png").stat().st_size > 1000


@pytest.mark.parametrize("recipe", ["tensorwise",
                                    pytest.param("rowwise", marks=pytest.mark.slow)])
def test_dry_run_of_fp8_tp_sp_zero3_is_exact(tmp_path, recipe):
    """`fived train --dry-run --fp8 R --tp 2 --sequence-parallel --dp 2 --zero 3` then
    `fived ledger --check`: every rank's traffic (the amax all-reduces on tp, the SP columns'
    backward re-gather gone) and model states exact, the activations within 0.5 % (rowwise
    keeps the gathered input once per column region: saving its (N, K) reshape instead, a copy
    of the strided gathered tensor, was 31 % above the ledger)."""
    from parity_helpers import dry_run_is_exact

    c = dry_run_is_exact(tmp_path, "--fp8", recipe, "--precision", "bf16", "--tp", "2",
                         "--sequence-parallel", "--dp", "2", "--zero", "3")
    assert c.returncode == 0, c.stdout + c.stderr
    assert "!=" not in c.stdout
