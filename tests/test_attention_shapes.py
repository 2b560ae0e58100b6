"""Attention shapes (``ModelConfig.head_size``, ``qk_norm``, ``qkv_bias``: Qwen2/Qwen3): a tiny
model with heads·head_dim ≠ hidden, q/k norms and q/k/v biases trains at tp2 (with and without
sequence parallelism, and with replicated kv heads), cp2 (ring and Ulysses), pp2 and dp2 ZeRO-3
to the one-rank reference's losses and gradients; the ledger's parameters (per rank, in the
engine's order), tp traffic and saved activations are the runtime's; bad shapes are one clear
error. World 4 (tp2·cp2, tp2·pp2, tp4) is under ``-m slow``."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.ledger import memory, params
from fived.parallel.tensor import tp_traffic_bytes
from fived.testing import small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, offline_grid, one_rank, train_runs  # noqa: E402

# hidden 32, 4 heads of 12 (q and the attention output are 48 wide), 2 kv heads
QWEN = replace(preset("tiny"), name="attn-shapes", hidden=32, heads=4, kv_heads=2, head_size=12,
               qk_norm=True, qkv_bias=True, ffn=64, layers=2, seq_len=16)
KV1 = replace(QWEN, name="attn-shapes-kv1", kv_heads=1)  # tp2 replicates the kv head
TRAIN = small_train(steps=4)
ADAFACTOR = replace(TRAIN, optimizer="adafactor")  # row/column statistics of the cut biases


@pytest.fixture(scope="module")
def reference():
    return {(m.name, t.optimizer): one_rank(m, t)
            for m, t in ((QWEN, TRAIN), (KV1, TRAIN), (QWEN, ADAFACTOR))}


def check_traffic(out: dict, model, par: ParallelConfig) -> None:
    """The tp bytes every rank recorded in the last step == the ledger's formula."""
    micro = TRAIN.global_batch // (par.dp * par.ep) // par.micro_batches
    want = sum(tp_traffic_bytes(model, par, micro).values())
    for s in out["ranks"]:
        assert s["history"][-1]["traffic"].get("tp", 0) == want, (par.describe(), want)


WORLD2 = [
    (QWEN, ParallelConfig(tp=2), TRAIN),
    (QWEN, ParallelConfig(tp=2, sequence_parallel=True), TRAIN),
    (KV1, ParallelConfig(tp=2, sequence_parallel=True), TRAIN),
    (QWEN, ParallelConfig(cp=2), TRAIN),
    (QWEN, ParallelConfig(cp=2, cp_mode="ulysses"), TRAIN),
    (QWEN, ParallelConfig(pp=2, micro_batches=2), TRAIN),
    (QWEN, ParallelConfig(dp=2, zero=3), TRAIN),
    (QWEN, ParallelConfig(tp=2), ADAFACTOR),
]


def test_world2_layouts_match_one_rank(reference):
    """One spawn of 2 ranks trains every layout; each equals the one-rank run (losses of every
    step on every rank, the gathered first-step gradients — the q/k norm gains' included, whose
    tp replicas must agree exactly), and its tp bytes are the ledger's; Adafactor at tp2 (its
    factored statistics of a tp-cut bias, one row cut along its columns, summed over tp)."""
    outs = train_runs(WORLD2)
    for (m, par, t), out in zip(WORLD2, outs):
        check_parity(out, reference[m.name, t.optimizer], (m.name, par.describe(), t.optimizer))
        if par.tp > 1 and t.optimizer == "adamw":
            check_traffic(out, m, par)
    ref = reference[QWEN.name, "adamw"]
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.slow
def test_world4_layouts_match_one_rank(reference):
    runs = [(QWEN, ParallelConfig(tp=2, cp=2, sequence_parallel=True)),
            (QWEN, ParallelConfig(tp=2, pp=2, micro_batches=2)),
            (QWEN, ParallelConfig(tp=4)),  # 2 kv heads over 4 ranks: replicated
            (QWEN, ParallelConfig(tp=2, dp=2, zero=3, sequence_parallel=True))]
    outs = train_runs([(m, p, TRAIN) for m, p in runs])
    for (m, par), out in zip(runs, outs):
        check_parity(out, reference[m.name, "adamw"], (m.name, par.describe()))
        check_traffic(out, m, par)


def test_the_model_has_the_qwen_shapes():
    from fived.model import build_model

    model = build_model(QWEN, 1)
    p = dict(model.named_parameters())
    a = "layers.0.self_attn."
    assert p[a + "q_proj.weight"].shape == (48, 32) and p[a + "q_proj.bias"].shape == (48,)
    assert p[a + "k_proj.bias"].shape == (24,) and p[a + "v_proj.bias"].shape == (24,)
    assert p[a + "o_proj.weight"].shape == (32, 48) and a + "o_proj.bias" not in p
    assert p[a + "q_norm.weight"].shape == (12,) and p[a + "k_norm.weight"].shape == (12,)
    x = torch.randint(0, QWEN.vocab, (2, QWEN.seq_len))
    loss = model(x, torch.arange(QWEN.seq_len), x)
    loss.backward()
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in p.values())


@pytest.mark.parametrize("par", [ParallelConfig(), ParallelConfig(tp=2),
                                 ParallelConfig(tp=4), ParallelConfig(tp=2, pp=2)],
                         ids=["one-rank", "tp2", "tp4-replicated-kv", "tp2-pp2"])
def test_ledger_params_are_the_runtime_pieces(par):
    """``param_list`` (names, elements; the order on one stage) and ``rank_params`` are each
    rank's cut model."""
    from fived.model import build_model
    from fived.parallel.parallelize import parallelize_parts

    for rank in range(par.world_size):
        grid = offline_grid(par, rank)
        parts, _ = parallelize_parts(build_model(QWEN, 0, device="meta", init=False), grid, par)
        have = [(n, p.numel()) for part in parts for n, p in part.named_parameters()]
        pp_rank = grid.coords(rank)["pp"]
        want = [(n, k) for n, k, _ in params.param_list(QWEN, par, pp_rank)]
        if par.pp > 1:  # a stage's part registers its embedding after its blocks
            have, want = sorted(have), sorted(want)
        assert have == want, (rank, set(have) ^ set(want))
        assert params.rank_params(QWEN, par, pp_rank).total == sum(k for _, k in have)
    whole = build_model(QWEN, 0, device="meta", init=False)
    assert params.total_params(QWEN) == sum(p.numel() for p in whole.parameters())


def test_ledger_flops_use_heads_times_head_dim():
    from fived.ledger import compute

    h, a = QWEN.hidden, QWEN.attn_dim  # 32, 48
    per_block = h * (a + 2 * QWEN.kv_heads * QWEN.head_dim) + a * h + 3 * h * QWEN.ffn
    assert params.block_matmul_params(QWEN) == per_block
    assert compute.attention_flops_per_token(QWEN) == 4 * QWEN.layers * QWEN.seq_len * a


@pytest.mark.parametrize("fp", ["fp32", "bf16"])
def test_qk_norm_activation_term_is_what_autograd_saves(fp):
    """The ledger's qk_norm term is, to the byte, what turning qk_norm on adds to autograd's
    saves (one block; fp32 and bf16); biases add nothing."""
    from fived.model.layers import rope_tables
    from fived.model.llama import Block
    from fived.train.activations import SavedTensors

    dtype = torch.float32 if fp == "fp32" else torch.bfloat16
    par = ParallelConfig(precision=fp)

    def saved(m) -> int:
        blk = Block(m, 0, dtype)
        x = torch.randn(2, m.seq_len, m.hidden, dtype=dtype, requires_grad=True)
        rope = rope_tables(torch.arange(m.seq_len), m.head_dim, m.rope_theta, dtype)
        with SavedTensors(list(blk.parameters()) + [x, *rope]) as s:
            blk(x, rope)
        return s.bytes

    plain = replace(QWEN, qk_norm=False, qkv_bias=False)
    for m in (QWEN, replace(QWEN, qkv_bias=False), replace(QWEN, qk_norm=False)):
        extra = saved(m) - saved(plain)
        pred = (sum(memory.layer_activations(m, par, 2).values())
                - sum(memory.layer_activations(plain, par, 2).values()))
        assert extra == pred, (m.qk_norm, m.qkv_bias, extra, pred)
    assert memory.layer_activations(QWEN, par, 2)["qk_norm"] > 0


def test_dry_run_matches_the_ledger_tp2_cp2_and_tp2_pp2(tmp_path):
    """All three options: ``fived train --dry-run`` of a TOML model at tp2·cp2·dp2 (SP, ZeRO-1)
    then ``fived ledger --check`` on its metrics file, and tp2·pp2 in Python: the dry run's
    model states and traffic equal the ledger's to the byte, its activation peak within the
    stated tolerance."""
    from fived.cli import main
    from fived.config import dump_toml
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    train = small_train(global_batch=4)
    toml, path = tmp_path / "qwen.toml", tmp_path / "qwen.jsonl"
    toml.write_text(dump_toml(replace(QWEN, name="tiny"), ParallelConfig(), train))  # tiny, reshaped
    assert main(["train", "--config", str(toml), "--dry-run", "--tp", "2", "--cp", "2",
                 "--dp", "2", "--sequence-parallel", "--zero", "1",
                 "--metrics-out", str(path)]) == 0
    run = json.loads(path.read_text().splitlines()[0])["run"]["model"]
    assert (run["head_size"], run["qk_norm"], run["qkv_bias"]) == (12, True, True)
    m, lay, gb = verify.run_of_file(str(path))  # as ``fived ledger --check`` reads it: the
    # states, the traffic and the saved activations exact (the step's peak of a cp layout is
    # not modelled to 0.5 % yet: docs/ledger.md, "The step's peak")
    assert verify.compare_file(m, lay, gb, str(path)) == []
    par = ParallelConfig(tp=2, pp=2, micro_batches=2)
    out = dry_run(QWEN, par, train, distinct_ranks(par), out_path=str(tmp_path / "d.jsonl"),
                  show=False)
    assert verify.compare_record(QWEN, par, train.global_batch, out) == [], par.describe()


@pytest.mark.parametrize("change,par,words", [
    (dict(head_size=11), ParallelConfig(), "head_size 11 must be even for RoPE"),
    (dict(head_size=0, hidden=30), ParallelConfig(), "hidden 30 is not divisible by heads 4"),
    (dict(), ParallelConfig(tp=3), "--tp 3: attn-shapes's attention heads 4"),
    (dict(kv_heads=3, heads=6), ParallelConfig(tp=2), "kv_heads 3 is not divisible by 2"),
    (dict(bias=True), ParallelConfig(), "qkv_bias with bias = true"),
])
def test_bad_shapes_are_one_clear_error(change, par, words):
    with pytest.raises(ConfigError) as e:
        validate(replace(QWEN, **change), par)
    assert words in str(e.value)


def test_bad_shape_from_toml_exits_2_before_any_rank(tmp_path, capsys):
    from fived.cli import main

    cfg = tmp_path / "bad.toml"
    cfg.write_text('[model]\nhead_size = 7\nqk_norm = true\n')
    assert main(["train", "--config", str(cfg), "--nprocs", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "head_size 7 must be even for RoPE" in err


def test_the_dtensor_bench_peer_refuses_the_options():
    from fived.bench.tp import dtensor_model

    for m in (replace(QWEN, qkv_bias=False), replace(QWEN, qk_norm=False)):
        with pytest.raises(ConfigError, match="not supported there"):
            dtensor_model(m, 0, 2, False)
