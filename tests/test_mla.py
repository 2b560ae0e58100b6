"""Multi-head latent attention (``fived.model.mla``) under every dimension: the tiny
DeepSeek-V3-shaped preset (query compression, YaRN, sigmoid routing over groups with the
selection bias, a shared expert, a dense first block) trains at tp2 (± SP), cp2 (ring and
Ulysses), pp2, dp2 ZeRO-3 with full recompute and ep2 to the one-rank reference's losses and
gradients, with the tp and cp bytes the ledger's; the 4-rank layouts and the 4-D
pp2·ep2·cp2·tp2 are under ``-m slow``. The ledger (parameters, FLOPs, saved bytes against
autograd and Megatron-Core's formula, the clock), the dry run, the latent cache of generation
and the bad MLA fields are checked here too. Mutations seen to fail: the SharedKey row removed
(tp2+SP breaks), the down-projection's Partial row off (replicas differ), the rotary key's
all-reduce dropped from the ledger (tp bytes), cp's d_q replaced by head_dim (cp bytes), the
latent storage's d_r dropped from the activation terms (saved bytes), the narrow core's v
counted at d_q in ``layer_activations`` or in ``selective_layer`` (saved bytes)"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.testing import small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, one_rank, train_runs  # noqa: E402

DS = preset("deepseek-v3-tiny")
PLAIN_Q = replace(DS, name="mla-plain-q", q_lora_rank=0, rope_factor=1.0,
                  rope_mscale_all_dim=0.0, experts=0, shared_expert=False, route_groups=0,
                  route_top_groups=0, first_dense_layers=0, balance="aux_loss",
                  router="softmax", layers=2)
TRAIN = small_train(steps=3)


@pytest.fixture(scope="module")
def reference():
    return {m.name: one_rank(m, TRAIN) for m in (DS, PLAIN_Q)}


WORLD2 = [
    (DS, ParallelConfig(tp=2), TRAIN),
    (DS, ParallelConfig(tp=2, sequence_parallel=True), TRAIN),
    (PLAIN_Q, ParallelConfig(tp=2, sequence_parallel=True), TRAIN),
    (DS, ParallelConfig(cp=2), TRAIN),
    (DS, ParallelConfig(cp=2, cp_mode="ulysses"), TRAIN),
    (DS, ParallelConfig(pp=2, micro_batches=2), TRAIN),
    (DS, ParallelConfig(dp=2, zero=3, recompute="full"), TRAIN),
    (DS, ParallelConfig(ep=2), TRAIN),
]


def check_traffic(out: dict, model, par: ParallelConfig) -> None:
    """The tp and cp bytes every rank recorded in the last step == the ledger's formulas."""
    from fived.ledger.traffic import cp_traffic, tp_traffic

    micro = TRAIN.global_batch // (par.dp * par.ep) // par.micro_batches
    for s in out["ranks"]:
        pp_rank = s.get("coords", {}).get("pp", 0) if par.pp > 1 else 0
        for group, fn in (("tp", tp_traffic), ("cp", cp_traffic)):
            want = sum(c.bytes for c in fn(model, par, micro, pp_rank))
            assert s["history"][-1]["traffic"].get(group, 0) == want, (par.describe(), group)


def test_world2_layouts_match_one_rank(reference):
    """One spawn of 2 ranks trains every layout; each equals the one-rank run (losses of every
    step on every rank, the gathered first-step gradients: the latent projections and norms,
    the rotary key's projection rows summed over tp), and its tp and cp bytes are the
    ledger's."""
    outs = train_runs(WORLD2)
    for (m, par, _), out in zip(WORLD2, outs):
        check_parity(out, reference[m.name], (m.name, par.describe()))
        check_traffic(out, m, par)
    ref = reference[DS.name]
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.slow
def test_world4_layouts_match_one_rank(reference):
    runs = [(DS, ParallelConfig(ep=2, tp=2, sequence_parallel=True)),
            (DS, ParallelConfig(tp=2, cp=2, sequence_parallel=True)),
            (DS, ParallelConfig(tp=2, cp=2, zero=1, cp_mode="ulysses", sequence_parallel=True)),
            (DS, ParallelConfig(tp=4))]
    outs = train_runs([(m, p, TRAIN) for m, p in runs])
    for (m, par), out in zip(runs, outs):
        check_parity(out, reference[m.name], (m.name, par.describe()))
        check_traffic(out, m, par)


@pytest.mark.slow
def test_4d_layout_matches_one_rank(reference):
    """pp2·ep2·cp2·tp2 with SP and ZeRO-1 over the dense group (16 ranks): the one-rank
    losses and gradients, tp and cp bytes the ledger's."""
    par = ParallelConfig(pp=2, ep=2, cp=2, tp=2, micro_batches=2, sequence_parallel=True,
                         zero=1)
    train = replace(TRAIN, global_batch=8)
    out = train_runs([(DS, par, train)], timeout=1800)[0]
    check_parity(out, one_rank(DS, train), (DS.name, par.describe()))


def test_the_model_has_deepseeks_shapes():
    from fived.model import build_model

    model = build_model(DS, 1)
    p = dict(model.named_parameters())
    a = "layers.0.self_attn."
    assert p[a + "q_a_proj.weight"].shape == (16, 32)
    assert p[a + "q_b_proj.weight"].shape == (4 * 12, 16)
    assert p[a + "kv_a_proj_with_mqa.weight"].shape == (12 + 4, 32)
    assert p[a + "kv_b_proj.weight"].shape == (4 * (8 + 6), 12)
    assert p[a + "o_proj.weight"].shape == (32, 4 * 6)
    x = torch.randint(0, DS.vocab, (2, DS.seq_len))
    model(x, torch.arange(DS.seq_len), x).backward()
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in p.values())


@pytest.mark.parametrize("change,par,words", [
    (dict(qk_rope_head_dim=5), ParallelConfig(), "qk_rope_head_dim 5 must be even"),
    (dict(kv_lora_rank=0), ParallelConfig(), "kv_lora_rank 0:"),
    (dict(), ParallelConfig(tp=3), "attention heads 4"),
    (dict(v_head_dim=20), ParallelConfig(), "v_head_dim 20"),
    (dict(qk_norm=True), ParallelConfig(), "qk_norm = True with MLA"),
])
def test_bad_mla_fields_are_one_clear_error(change, par, words):
    with pytest.raises(ConfigError) as e:
        validate(replace(DS, **change), par)
    assert words in str(e.value)


@pytest.mark.parametrize("par", [ParallelConfig(), ParallelConfig(tp=2),
                                 ParallelConfig(tp=2, pp=2), ParallelConfig(ep=2, tp=2)],
                         ids=["one-rank", "tp2", "tp2-pp2", "ep2-tp2"])
def test_ledger_params_are_the_runtime_pieces(par):
    """``param_list`` (names, elements) and ``rank_params`` (with what tp replicates: the
    down-projections and latent norms) are each rank's cut MLA model."""
    from parity_helpers import offline_grid

    from fived.ledger import params
    from fived.model import build_model
    from fived.parallel.parallelize import parallelize_parts

    for rank in range(par.world_size):
        grid = offline_grid(par, rank)
        parts, placements = parallelize_parts(build_model(DS, 0, device="meta", init=False),
                                              grid, par)
        have = [(n, p.numel()) for part in parts for n, p in part.named_parameters()]
        pp_rank = grid.coords(rank)["pp"]
        want = [(n, k) for n, k, _ in params.param_list(DS, par, pp_rank)]
        if par.pp > 1:
            have, want = sorted(have), sorted(want)
        if par.ep > 1:  # the ledger numbers a rank's experts from 0: compare the counts
            have, want = sorted(k for _, k in have), sorted(k for _, k in want)
        assert have == want, (rank, par.describe())
        rp = params.rank_params(DS, par, pp_rank)
        assert rp.total == sum(p.numel() for part in parts for p in part.parameters())
        whole = sum(p.numel() for part in parts for n, p in part.named_parameters()
                    if placements[n].parts == 1)
        assert rp.replicated_in_tp == (whole if par.tp > 1 else rp.replicated_in_tp)


def test_ledger_flops_count_mla_matmuls():
    """2·Ψ_matmul per token is what the forward's matmuls do (torch's FLOP counter, a dense
    MLA block with and without query compression); the core's 2·s·H·(d_q + d_v) is GQA's
    4·s·heads·head_dim when v is as wide as q/k (CPU SDPA is not counted by torch)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fived.ledger import compute, params
    from fived.model import build_model

    for m in (replace(PLAIN_Q, q_lora_rank=16), PLAIN_Q, replace(PLAIN_Q, v_head_dim=12)):
        model = build_model(m, 0)
        x = torch.randint(0, m.vocab, (2, m.seq_len))
        with FlopCounterMode(display=False) as fc:
            model(x, torch.arange(m.seq_len))
        got = fc.get_flop_counts()["Global"]
        mm = sum(v for k, v in got.items() if "mm" in str(k))
        tokens = 2 * m.seq_len
        assert mm == 2 * params.layers_matmul_params(m, range(m.layers)) * tokens \
            + 2 * m.hidden * m.vocab * tokens
        if m.v_head_dim == m.qk_head_dim:  # GQA's 4·s·heads·head_dim at head_dim = d_q
            assert compute.attention_flops_per_token(m) == \
                4 * m.layers * m.seq_len * m.heads * m.qk_head_dim


def test_deepseek_v3_and_kimi_k2_presets_count_their_published_sizes():
    from fived.ledger import params

    ds, k2 = preset("deepseek-v3-671b"), preset("kimi-k2")
    assert params.total_params(ds) == 671_026_404_352  # "671B total, 37B activated"
    assert round(params.active_params(ds) / 1e9) == 38 and params.active_params(ds) > 37e9
    assert round(params.total_params(k2) / 1e12, 2) == 1.03  # "1.04T total, 32B activated"
    assert round(params.active_params(k2) / 1e9) == 33
    for m in (ds, k2):
        validate(m, ParallelConfig())


@pytest.mark.parametrize("fp", ["fp32", "bf16"])
def test_ledger_activation_terms_are_what_autograd_saves(fp):
    """One MLA block (dense MLP) saves, to the byte, the ledger's layer terms (less the block's
    input and the CUDA flash kernel's RNG state, which a CPU forward does not keep): with and
    without query compression, v narrower than q/k (o_proj's copy) and as wide (none)."""
    from fived.ledger import memory
    from fived.model.layers import rope_tables
    from fived.model.llama import Block
    from fived.model.mla import yarn_of
    from fived.parallel.recompute import _checkpointed
    from fived.train.activations import SavedTensors

    dtype = torch.float32 if fp == "fp32" else torch.bfloat16
    e = 4 if fp == "fp32" else 2
    par = ParallelConfig(precision=fp)
    dense = replace(PLAIN_Q, q_lora_rank=16, rope_factor=4.0, rope_mscale_all_dim=0.8)
    for m in (dense, PLAIN_Q, replace(dense, v_head_dim=12)):
        blk = Block(m, 0, dtype)
        x = torch.randn(2, m.seq_len, m.hidden, dtype=dtype, requires_grad=True)
        rope = rope_tables(torch.arange(m.seq_len), m.rope_dim, m.rope_theta, dtype, yarn_of(m))
        with SavedTensors(list(blk.parameters()) + [x, *rope]) as s:
            blk(x, rope)
        terms = memory.layer_activations(m, par, 2)
        assert s.bytes == sum(terms.values()) - 2 * m.seq_len * m.hidden * e \
            - memory.FLASH_RNG_BYTES, (m.q_lora_rank, m.v_head_dim)
        assert terms["mla_latent"] > 0
        _checkpointed(blk.self_attn.core)  # selective recompute: the core's inputs kept
        with SavedTensors(list(blk.parameters()) + [x, *rope]) as s:
            blk(x, rope)
        sel = memory.selective_layer(m, par, 2)
        assert s.bytes == sum(sel.values()) - 2 * m.seq_len * m.hidden * e, m.v_head_dim


def test_narrow_v_core_is_the_padded_core_bit_for_bit():
    """MLA's core with v at d_v < d_q (``NarrowVFlash``): its output and the gradients of q,
    k, v equal the flash core's over v zero-padded to d_q, exactly, in fp32 and bf16; it saves
    q, k, v at d_v, the d_v output and the log-sum-exp; on meta tensors (the dry run) it runs
    forward and backward at the same shapes."""
    import torch.nn.functional as F

    from fived.model.layers import flash_attention
    from fived.model.mla import MLACore
    from fived.train.activations import SavedTensors

    b, s, H, dq, dv = 2, 16, 3, 12, 6
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(b, s, H, d, dtype=dtype, requires_grad=True)
                   for d in (dq, dq, dv))
        g = torch.randn(b, s, H, dv, dtype=dtype)
        with SavedTensors([q, k, v]) as saved:
            o = MLACore()(q * 1, k * 1, v * 1)
        o.backward(g)
        got = [o.detach(), q.grad, k.grad, v.grad]
        for t in (q, k, v):
            t.grad = None
        ref = flash_attention(q, k, F.pad(v, (0, dq - dv)))[..., :dv]
        ref.backward(g)
        for a, r in zip(got, [ref.detach(), q.grad, k.grad, v.grad]):
            assert torch.equal(a, r)
        e = q.element_size()
        assert saved.bytes == b * s * H * e * (2 * dq + 2 * dv) + b * H * s * 4
    q, k, v = (torch.empty(b, s, H, d, device="meta", requires_grad=True) for d in (dq, dq, dv))
    o = MLACore()(q, k, v)
    o.sum().backward()
    assert o.shape == (b, s, H, dv) and v.grad.shape == v.shape and q.grad.shape == q.shape


def check_dry_run(par: ParallelConfig) -> None:
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    train = small_train(global_batch=4)
    out = dry_run(DS, par, train, distinct_ranks(par), out_path=None, show=False)
    problems = verify.compare_record(DS, par, train.global_batch, out)
    assert problems == [], (par.describe(), problems)


def test_dry_run_matches_the_ledger():
    """The dry run (fake tensors, the CUDA flash op's meta kernel) of MLA at tp2 with SP and
    ZeRO-1 over dp2: model states and traffic equal the ledger's to the byte, saved
    activations within the stated tolerance, the step peak within 0.5 %."""
    check_dry_run(ParallelConfig(tp=2, dp=2, sequence_parallel=True, zero=1))


@pytest.mark.slow
@pytest.mark.parametrize("par", [
    ParallelConfig(tp=2, cp=2, ep=2, sequence_parallel=True),
    ParallelConfig(tp=2, pp=2, micro_batches=2, recompute="selective"),
    ParallelConfig(tp=2, cp=2, cp_mode="ulysses", recompute="full")],
    ids=["tp2-cp2-ep2-sp", "tp2-pp2-selective", "ulysses-full"])
def test_dry_run_matches_the_ledger_4d(par):
    check_dry_run(par)


def megatron_mla_bytes_per_token(m, t: int) -> float:
    """Megatron-Core's saved bytes per token of one dense MLA layer, bf16, SP, no recompute,
    TE spec (docs/ledger.md derives it from multi_latent_attention.py): 8h/t + 4·r_q/t +
    (4·r_kv + 2·d_r)/t + 4·H·(d_q + d_v)/t + 6f/t."""
    return (8 * m.hidden + 4 * m.q_lora_rank + 4 * m.kv_lora_rank + 2 * m.qk_rope_head_dim
            + 4 * m.heads * (m.qk_head_dim + m.v_head_dim) + 6 * m.ffn) / t


@pytest.mark.parametrize("t", [1, 8])
def test_layer_activations_against_megatron_mla(t):
    """DeepSeek-V3's dense block at seq 4096, bf16, SP: the ledger's bytes are Megatron-Core's
    plus what fived keeps besides — the fp32 1/rms of four norms and the log-sum-exp,
    (16 + 4H)/t (MLA's own core keeps v and its output at d_v, as Megatron's cuDNN core does);
    under context parallelism the core pads v: 2·H·(2·d_q − d_v)/t more (per token of the
    rank's shard), and Ulysses adds its all-to-alls' int64 index."""
    from fived.ledger import memory
    from fived.ledger.params import dense_block_cfg

    m = dense_block_cfg(preset("deepseek-v3-671b"))
    par = ParallelConfig(tp=t, sequence_parallel=t > 1, precision="bf16")
    ours = sum(memory.layer_activations(m, par, 1, memory.FUSED).values()) / m.seq_len
    meg = megatron_mla_bytes_per_token(m, t)
    assert ours == pytest.approx(meg + (16 + 4 * m.heads) / t)
    assert ours / meg < 1.002
    cp = replace(par, cp=2, cp_mode="ulysses")
    uly = sum(memory.layer_activations(m, cp, 1, memory.FUSED).values()) / (m.seq_len / 2)
    pad = 2 * m.heads * (2 * m.qk_head_dim - m.v_head_dim) / t
    # the all-to-alls' index; the padded output ``pad`` counts is the kernel's head-sharded
    # one (its save), and the sequence-sharded one the all-to-all returns is cut to d_v before
    # o_proj and saved by nothing (the dry run's saves: ``test_mla_cp``)
    ulysses_extra = 4 * m.seq_len * 8.0 / (m.seq_len / 2)
    assert uly == pytest.approx(meg + (16 + 4 * m.heads) / t + pad + ulysses_extra)


# ------------------------------------------------------------------ generation: the latent cache
def _tp_generate(rank: int, world: int, cfg) -> list[list[int]]:
    from fived.comm import ops
    from fived.comm.ops import Traffic
    from fived.infer.generate import generate
    from fived.infer.model import inference_model
    from fived.model.init import InitSource
    from fived.model.llama import Transformer
    from fived.ranks.grid import Grid

    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(Traffic())
    src = InitSource(3, Transformer(cfg, [], False, False).param_std)
    model = inference_model(cfg, grid, src, "cpu")
    return generate(model, PROMPTS, 12,
                    gather=lambda z: ops.all_gather(z, grid["tp"], dim=-1)).tokens


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]


def test_latent_cache_generates_the_no_cache_tokens_absorbed_or_not_and_at_tp2():
    """Greedy tokens with the latent cache equal a no-cache loop over the plain model, batched
    or alone, with the up-projections absorbed, expanded or "auto"; the cache holds
    layers·b·slots·(r_kv + d_r) values; tp2 (each rank its heads, the latent whole) gives the
    same tokens."""
    from test_generate import no_cache

    from fived.infer.generate import generate
    from fived.model import build_model
    from fived.model.mla import MLAttention
    from fived.testing import run_ranks

    cfg = replace(DS, seq_len=64)
    model = build_model(cfg, 3).eval()
    want = [no_cache(model, p, 12) for p in PROMPTS]
    for mode in (False, True, "auto"):
        for m in model.modules():
            if isinstance(m, MLAttention):
                m.absorb = mode
        out = generate(model, PROMPTS, 12)
        assert out.tokens == want, mode
        assert generate(model, PROMPTS[1:2], 12).tokens[0] == want[1]
    slots = max(map(len, PROMPTS)) + 12
    assert out.cache_bytes == cfg.layers * 3 * slots * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    for got in run_ranks(_tp_generate, 2, cfg):
        assert got == want


def test_the_clock_times_mla_at_its_own_shapes():
    """The roofline's GEMMs of an MLA block are 2·block_matmul_params FLOPs per token (tp1 and
    tp8+SP, where the down-projections see the sequence shard but are whole), its flash core
    2·s²·H·(d_q + d_v)/2 forward."""
    from fived.ledger import params, roofline

    m = preset("deepseek-v3-671b")
    dense = params.dense_block_cfg(m)
    ops = roofline.block_ops(dense, ParallelConfig(precision="bf16"), 1, roofline.ClockOptions())
    gemm = sum(o.flops for o in ops["fwd"] if o.kind == "gemm")
    assert gemm == pytest.approx(2 * params.block_matmul_params(dense) * m.seq_len)
    attn = sum(o.flops for o in ops["fwd"] if o.kind == "attn")
    assert attn == pytest.approx(2 * m.seq_len ** 2 * m.heads * (192 + 128) / 2)
    sp = ParallelConfig(tp=8, sequence_parallel=True, precision="bf16")
    ops8 = roofline.block_ops(dense, sp, 1, roofline.ClockOptions())
    down = sum(o.flops for o in ops8["fwd"] if o.name in ("q_a", "kv_a"))
    assert down == pytest.approx(2 * m.hidden * (1536 + 512 + 64) * m.seq_len / 8)
