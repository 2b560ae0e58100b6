"""MLA's latent ring (``--cp-mode ring-latent``, ``fived.parallel.context.LatentRing``): the
latent [c ; kᴿ] travels the cp ring, each rank up-projects every block it holds through its
W_kvb, dlatent travels home. Equal to the one-rank reference (losses and gradients, fp32) at
cp2 with and without query compression and with document masks (zigzag and ptrr); under
``-m slow`` at cp4, tp2·cp2 (± SP), dp2·cp2 ZeRO-3, pp2·cp2 (± multi-token prediction), full
and selective recompute. Its cp
bytes (and the tp bytes it changes under SP) are the ledger's, in real runs and in the dry run;
its saved bytes per layer are autograd's to the byte; the decompressed ring stays reachable
(``--cp-mode ring``) and the latent ring sends fewer bytes. Bad input: the mode on a model
without a latent, or with ``--fp8``, is one message, exit 2.

Mutations seen to fail: the ledger's latent width without d_r (cp bytes, real run and dry
run), the SP re-gather of W_kvb's input still counted (tp bytes, dry run), the latent's d_r
dropped or the latent norm's output still counted (saved bytes), the dlatent's rotary part
dropped or W_kvb's gradient of the blocks not added (gradients), the clock's core forward
without the ring's up-projections.
"""

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
                  router="softmax", layers=2, shared_expert_ffn=0)
TRAIN = small_train(steps=3)
LATENT = ParallelConfig(cp=2, cp_mode="ring-latent")


def check_traffic(out: dict, model, par: ParallelConfig, train=TRAIN) -> None:
    """The tp and cp bytes every rank recorded in the last step == the ledger's formulas."""
    from fived.ledger.traffic import cp_traffic, tp_traffic

    micro = train.global_batch // (par.dp * par.ep) // par.micro_batches
    for s in out["ranks"]:
        pp_rank = s.get("coords", {}).get("pp", 0) if par.pp > 1 else 0
        for group, fn in (("tp", tp_traffic), ("cp", cp_traffic)):
            want = sum(c.bytes for c in fn(model, par, micro, pp_rank))
            assert s["history"][-1]["traffic"].get(group, 0) == want, (par.describe(), group)


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    from doc_helpers import prepared

    from fived.data.meta import model_for_data

    data = prepared(tmp_path_factory.mktemp("docs"))
    model = model_for_data(PLAIN_Q, data)
    return model, small_train(steps=2, data=data, doc_mask=True)


def test_latent_ring_cp2_matches_one_rank(docs):
    """One spawn of 2 ranks: the latent ring at cp2 with query compression (the tiny
    DeepSeek-V3: MoE, YaRN), without it (a plain q), and with document masks (zigzag and
    ``--cp-balance ptrr``) equals the one-rank run, losses of every step and the gathered
    first-step gradients; its cp bytes are the ledger's and fewer than the decompressed
    ring's (the ledger's, for the same layout)."""
    from fived.ledger.traffic import cp_traffic

    dmodel, dtrain = docs
    runs = [(DS, LATENT, TRAIN), (PLAIN_Q, LATENT, TRAIN), (dmodel, LATENT, dtrain),
            (dmodel, LATENT, replace(dtrain, cp_balance="ptrr"))]
    for m, p, t in runs:
        validate(m, p, t, 2)
    outs = train_runs(runs, timeout=600)
    for (m, par, t), out in zip(runs, outs):
        check_parity(out, one_rank(m, t), (m.name, par.describe(), t.cp_balance))
        check_traffic(out, m, par, t)
    micro = TRAIN.global_batch  # dp 1, one micro-batch
    latent = sum(c.bytes for c in cp_traffic(DS, LATENT, micro))
    heads = sum(c.bytes for c in cp_traffic(DS, replace(LATENT, cp_mode="ring"), micro))
    assert outs[0]["ranks"][0]["history"][-1]["traffic"]["cp"] == latent < heads / 4


@pytest.mark.slow
def test_latent_ring_world4_layouts_match_one_rank():
    """cp4 (± query compression), tp2·cp2 (heads cut by tp, the latent whole) with and
    without SP, dp2·cp2 ZeRO-3, cp2 ZeRO-1 over dp2 with selective recompute: the one-rank
    losses and gradients, tp and cp bytes the ledger's."""
    latent4 = replace(LATENT, cp=4)
    runs = [(DS, latent4, TRAIN), (PLAIN_Q, latent4, TRAIN),
            (DS, replace(LATENT, tp=2), TRAIN),
            (DS, replace(LATENT, tp=2, sequence_parallel=True), TRAIN),
            (PLAIN_Q, replace(LATENT, tp=2, sequence_parallel=True), TRAIN),
            (DS, replace(LATENT, dp=2, zero=3), TRAIN),
            (DS, replace(LATENT, dp=2, zero=1, recompute="selective"), TRAIN)]
    outs = train_runs(runs, timeout=1800)
    for (m, par, t), out in zip(runs, outs):
        check_parity(out, one_rank(m, t), (m.name, par.describe()))
        check_traffic(out, m, par, t)


@pytest.mark.slow
def test_latent_ring_with_pp_and_full_recompute_matches_one_rank():
    """pp2·cp2 (two micro-batches; with multi-token prediction too, whose block is an MLA
    block on the ring) and cp2 with full recompute under tp2: the one-rank losses and
    gradients, tp and cp bytes the ledger's."""
    mtp = replace(DS, name="deepseek-v3-tiny-mtp", mtp_depth=1)
    runs = [(DS, replace(LATENT, pp=2, micro_batches=2), TRAIN),
            (mtp, replace(LATENT, pp=2, micro_batches=2), TRAIN),
            (DS, replace(LATENT, tp=2, recompute="full", sequence_parallel=True), TRAIN)]
    outs = train_runs(runs, timeout=1800)
    for (m, par, t), out in zip(runs, outs):
        check_parity(out, one_rank(m, t), (m.name, par.describe()))
        check_traffic(out, m, par, t)


class _OneRank:
    size, rank = 1, 0


@pytest.mark.parametrize("fp", ["fp32", "bf16"])
def test_latent_ring_saves_the_ledgers_bytes(fp):
    """One MLA block whose core is the latent ring saves, to the byte, the ledger's layer
    terms (less the block's input), with and without query compression, v narrower than q/k
    and as wide, without and with selective recompute; at tp2+SP the latent term is whole
    over tp (the ring's latent) and the norm's output a shard. The ring's saves do not depend
    on the ring's size: one rank runs the same Function (no exchange)."""
    from fived.ledger import memory
    from fived.model.layers import rope_tables
    from fived.model.llama import Block
    from fived.model.mla import yarn_of
    from fived.parallel.context import LatentRing
    from fived.parallel.recompute import _checkpointed
    from fived.train.activations import SavedTensors

    dtype = torch.float32 if fp == "fp32" else torch.bfloat16
    e = 4 if fp == "fp32" else 2
    par = replace(LATENT, precision=fp)
    dense = replace(PLAIN_Q, q_lora_rank=16, rope_factor=4.0, rope_mscale_all_dim=0.8)
    for m in (dense, PLAIN_Q, replace(dense, v_head_dim=12)):
        blk = Block(m, 0, dtype)
        blk.self_attn.core = LatentRing(_OneRank())
        x = torch.randn(2, m.seq_len, m.hidden, dtype=dtype, requires_grad=True)
        rope = rope_tables(torch.arange(m.seq_len), m.rope_dim, m.rope_theta, dtype, yarn_of(m))
        with SavedTensors(list(blk.parameters()) + [x, *rope]) as s:
            blk(x, rope)
        whole = replace(m, seq_len=2 * m.seq_len)  # cp2: the ledger's tokens are seq_len / 2
        terms = memory.layer_activations(whole, par, 2)
        assert s.bytes == sum(terms.values()) - 2 * m.seq_len * m.hidden * e, (m.q_lora_rank,
                                                                                 m.v_head_dim)
        _checkpointed(blk.self_attn.core)
        with SavedTensors(list(blk.parameters()) + [x, *rope]) as s:
            blk(x, rope)
        sel = memory.selective_layer(whole, par, 2)
        assert s.bytes == sum(sel.values()) - 2 * m.seq_len * m.hidden * e, m.v_head_dim
    # against the decompressed ring, per token: the latent instead of K and a padded V
    m, tok = DS, 2 * DS.seq_len / 2
    ring = memory.layer_activations(m, replace(par, cp_mode="ring"), 2)
    lat = memory.layer_activations(m, par, 2)
    assert ring["qkv"] - lat["qkv"] == tok * 4 * (
        2 * m.heads * m.qk_head_dim - m.kv_lora_rank - m.qk_rope_head_dim)
    sp = memory.layer_activations(m, replace(par, tp=2, sequence_parallel=True), 2)
    assert sp["qkv"] == tok * 4 * (m.heads / 2 * m.qk_head_dim + m.kv_lora_rank
                                   + m.qk_rope_head_dim)


def test_latent_ring_dry_run_matches_the_ledger():
    """The dry run (fake tensors) of the tiny DeepSeek-V3 at tp2·cp2 with SP on the latent
    ring: model states and traffic equal the ledger's to the byte, saved activations and the
    step peak within the stated tolerances (``verify.compare_record``)."""
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    par = replace(LATENT, tp=2, sequence_parallel=True)
    train = small_train(global_batch=4)
    out = dry_run(DS, par, train, distinct_ranks(par), out_path=None, show=False)
    assert verify.compare_record(DS, par, train.global_batch, out) == []


@pytest.mark.parametrize("mode", ["ring", "ulysses", "ring-latent"])
def test_mla_saves_under_each_cp_mode_are_the_ledgers(mode):
    """The dry run's peak of saved bytes (rank 0 of cp2, bf16) against the ledger's activations
    under each context-parallel core: equal up to 8 bytes a token (an int64 per token the
    ledger leaves out, there at one rank too). Under Ulysses the padded output the all-to-all
    returns is cut to d_v before o_proj and saved by nothing (the ledger counted it: 4,480
    bytes over on this model)."""
    from fived.config import TrainConfig
    from fived.ledger import memory
    from fived.train.dryrun import dry_run_rank

    par = ParallelConfig(cp=2, cp_mode=mode, precision="bf16")
    got = dry_run_rank(DS, par, TrainConfig(global_batch=2), 0)["activation_peak"]
    want = sum(memory.activations(DS, par, 2).values())
    tokens = 2 * DS.seq_len // 2
    assert 0 <= got - want <= 8 * tokens, (got, want)


@pytest.mark.parametrize("recipe,par", [
    ("tensorwise", ParallelConfig()),
    ("blockwise", ParallelConfig(cp=2, cp_mode="ulysses")),
    ("tensorwise", ParallelConfig(cp=2, cp_mode="ring")),
    ("tensorwise", ParallelConfig(tp=2, sequence_parallel=True)),
])
def test_mla_fp8_saves_are_the_ledgers(recipe, par):
    """MLA under fp8 (tensorwise, blockwise): only o_proj is an fp8 linear, so the block norm's
    output stays saved by the down-projections and no fp8 copy of it comes, and where the core
    pads v o_proj keeps its fp8 copy, not the d_v one (``memory.fp8_mla_attention``). The dry
    run's saved bytes equal the ledger's up to the 8 bytes a token the bf16 run leaves too (the
    ledger counted the dense block's terms: 508 bytes a layer under at one rank, 0.75 % over
    at cp2)."""
    from fived.config import TrainConfig
    from fived.ledger import memory
    from fived.train.dryrun import dry_run_rank

    par = replace(par, precision="bf16", fp8=recipe)
    got = dry_run_rank(DS, par, TrainConfig(global_batch=2), 0)["activation_peak"]
    want = sum(memory.activations(DS, par, 2).values())
    tokens = 2 * DS.seq_len // par.cp
    assert 0 <= got - want <= 8 * tokens, (got, want)


@pytest.mark.parametrize("model,par,words", [
    (preset("tiny"), LATENT, "--cp-mode ring-latent rotates MLA's latent"),
    (DS, replace(LATENT, fp8="tensorwise"), "--cp-mode ring-latent with --fp8 tensorwise"),
])
def test_latent_ring_bad_input_is_one_message(model, par, words):
    with pytest.raises(ConfigError) as err:
        validate(model, par)
    assert words in str(err.value)


def test_the_clock_counts_the_latent_rings_up_projections():
    """The roofline's W_kvb products of an MLA block at cp4: one forward and dX, dW without
    the latent ring; under it every block the rank holds (4) forward, and in backward again
    with dX and dW (``mla.kv_b_products``); selective recompute's core forward includes them."""
    from fived.ledger import mla, params, roofline

    m = params.dense_block_cfg(preset("deepseek-v3-671b"))
    heads = ParallelConfig(cp=4, precision="bf16")
    opts = roofline.ClockOptions()
    one = 2.0 * m.seq_len / 4 * m.kv_lora_rank * m.heads * (m.qk_nope_head_dim + m.v_head_dim)

    def kv_b(par, part):
        ops = roofline.block_ops(m, par, 1, opts)[part]
        return sum(o.flops for o in ops if o.name.startswith("kv_b"))

    assert (kv_b(heads, "fwd"), kv_b(heads, "bwd"), kv_b(heads, "core_fwd")) == (one, 2 * one, 0)
    latent = replace(heads, cp_mode="ring-latent")
    assert mla.kv_b_products(4, True) == (4, 12)
    assert (kv_b(latent, "fwd"), kv_b(latent, "bwd"), kv_b(latent, "core_fwd")) == (
        4 * one, 12 * one, 4 * one)


def test_the_planner_weighs_the_two_rings_of_an_mla_model():
    """The search tries an MLA layout with cp > 1 under both rings (``planner.cp_modes``) and
    keeps whichever its clock times faster: DeepSeek-V3 at 4K tokens over cp8, where the
    decompressed heads' exchange cannot hide behind a 256-token block, runs the latent ring;
    at 32K over cp2 the exchange hides and the latent ring's up-projections only cost. A fixed
    cp_mode, or a model without a latent, is searched as it is."""
    from fived.ledger import hardware, planner

    tiny, plain = preset("deepseek-v3-tiny"), preset("tiny")
    modes = {p.cp_mode for p, _ in planner.candidates(tiny, 8, 8, 16) if p.cp > 1}
    assert modes == {"ring", "ring-latent"}
    assert {p.cp_mode for p, _ in planner.candidates(tiny, 8, 8, 16, fixed={"cp_mode": "ring"})
            if p.cp > 1} == {"ring"}
    assert {p.cp_mode for p, _ in planner.candidates(plain, 8, 8, 16) if p.cp > 1} == {"ring"}
    m, hw = preset("deepseek-v3-671b"), hardware.PRESETS["h800"]

    def step(seq, cp, mode):
        ep = 128 // cp
        par = ParallelConfig(pp=16, schedule="dualpipe-v", virtual_stages=2, ep=ep, cp=cp,
                             zero=1, precision="bf16", micro_batches=32, recompute="full",
                             cp_mode=mode)
        return planner.predict(replace(m, seq_len=seq), par, hw, 32 * ep).step_seconds

    assert step(4096, 8, "ring-latent") < 0.7 * step(4096, 8, "ring")
    assert step(32768, 2, "ring") < step(32768, 2, "ring-latent")
