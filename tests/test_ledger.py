"""The ledger: parameter counts, model states by precision and ZeRO stage, activations, bubble,
traffic formulas, the planner's promise (it never returns a layout that does not fit), and the
runtime measured against the prediction."""

import json
from dataclasses import replace

import pytest

from fived.comm.volume import bytes_sent
from fived.config import ParallelConfig, preset
from fived.ledger import bubble, compute, hardware, memory, params, planner, traffic

# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize("name,count", [
    ("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
])
def test_parameter_counts_match_the_real_models(name, count):
    assert params.total_params(preset(name)) == count


def test_mixtral_count_and_active():
    m = preset("mixtral-8x7b")
    assert params.total_params(m) == 46_702_792_704  # the published 46.7B
    assert params.active_params(m) == 12_879_925_248  # ~12.9B active with top-2


def test_tiny_matches_the_runtime_model():
    torch = pytest.importorskip("torch")
    from fived.model import build_model

    for name in ("tiny", "tiny-moe"):
        m = preset(name)
        model = build_model(m, 1)
        assert sum(p.numel() for p in model.parameters()) == params.total_params(m)
    del torch


def test_rank_share_tp_pp_ep():
    m = preset("llama2-7b")
    full = params.total_params(m)
    # tp: everything but the replicated norms is cut tp ways
    r = params.rank_params(m, ParallelConfig(tp=4))
    norms = (2 * m.layers + 1) * m.hidden
    assert r.total == (full - norms) // 4 + norms
    assert r.replicated_in_tp == norms
    # pp: the stages add up to the model; embedding on the first, head + norm on the last
    par = ParallelConfig(pp=4)
    ranks = params.all_rank_params(m, par)
    assert sum(x.total for x in ranks) == full
    assert "embed" in ranks[0].breakdown and "head" not in ranks[0].breakdown
    assert "head" in ranks[3].breakdown and "norm" in ranks[3].breakdown
    # interleaved: rank r holds virtual stages r, r+pp
    par = ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved", micro_batches=2)
    assert params.rank_stages(par, 1) == [1, 3]
    assert sum(x.total for x in params.all_rank_params(m, par)) == full
    # ep: experts divide, the router and attention do not
    mx = preset("mixtral-8x7b")
    e1 = params.rank_params(mx, ParallelConfig(ep=1))
    e8 = params.rank_params(mx, ParallelConfig(ep=8, dp=1))
    assert e8.expert * 8 == e1.expert and e8.dense == e1.dense


def test_tied_embeddings_head_placement():
    m = replace(preset("tiny"), tied_embeddings=True)
    assert params.total_params(m) == params.total_params(preset("tiny")) - m.vocab * m.hidden
    # with pp > 1 the last stage holds its copy of the embedding (Megatron's embedding group)
    two = params.all_rank_params(m, ParallelConfig(pp=2))
    assert "head" not in two[1].breakdown and two[1].breakdown["embed"] == m.vocab * m.hidden
    assert params.embed_copies(m, ParallelConfig(pp=2)) == 2
    assert params.embed_copies(m, ParallelConfig(pp=2, schedule="zb-v", micro_batches=4)) == 1


# ------------------------------------------------------------------ model states


def test_bytes_per_param():
    assert memory.bytes_per_param(ParallelConfig(precision="fp32")) == 16
    assert memory.bytes_per_param(ParallelConfig(precision="bf16", grad_reduce_dtype="bf16")) == 16
    assert memory.bytes_per_param(ParallelConfig(precision="bf16", grad_reduce_dtype="fp32")) == 18


def test_fp32_ddp_is_4_4_0_8():
    m = preset("llama2-7b")
    n = params.total_params(m)
    s = memory.model_states(m, ParallelConfig(dp=8))
    assert s == {"params": 4 * n, "grads": 4 * n, "master": 0, "optimizer": 8 * n,
                 "buffers": 0, "padding": 0}


def test_zero_stages_hand_computed():
    # 10 elements over 4 ranks: shards of 3, padded buffer 12, last shard holds 1 real element
    assert memory.shard_len(10, 4) == 3
    assert [memory.shard_real(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    m = preset("llama2-7b")
    n = params.total_params(m)  # 6,738,415,616 = 8 · 842,301,952: no padding on 8 ranks
    bf = dict(precision="bf16", grad_reduce_dtype="bf16")
    z1 = memory.model_states(m, ParallelConfig(dp=8, zero=1, **bf))
    assert z1 == {"params": 2 * n, "grads": 2 * n, "master": 4 * n // 8,
                  "optimizer": 8 * n // 8, "buffers": 0, "padding": 0}
    z2 = memory.model_states(m, ParallelConfig(dp=8, zero=2, **bf))
    assert z2["grads"] == 2 * n // 8 and z2["params"] == 2 * n
    z3 = memory.model_states(m, ParallelConfig(dp=8, zero=3, **bf))
    assert sum(z3.values()) == 16 * n // 8
    # 18Ψ with the fp32 gradient buffer
    z0 = memory.model_states(m, ParallelConfig(dp=8, precision="bf16"))
    assert sum(z0.values()) == 18 * n



def test_zero3_buckets_and_padding_hand_computed():
    """tiny, fp32, ZeRO-3 over 3 ranks: one bucket per block (46,208 elements -> padded 46,209,
    shards of 15,403) and the root (embed 16,384 + norm 64 + head 16,384 = 32,832, no pad)."""
    m = preset("tiny")
    par = ParallelConfig(dp=3, zero=3)
    bks = memory.buckets(m, par)
    assert [b.numel for b in bks] == [46_208] * 4 + [32_832]
    assert [b.unit for b in bks] == [3, 2, 1, 0, -1]
    assert [b.pad for b in bks] == [1, 1, 1, 1, 0]
    ms = memory.model_states(m, par)
    shard = 4 * 15_403 + 10_944
    assert ms["params"] == 4 * shard and ms["grads"] == 4 * shard
    assert ms["master"] == 0 and ms["optimizer"] == 8 * shard
    assert ms["padding"] == pytest.approx(4 * 16 / 3)  # a shard's pad counts pad/N
    psi = params.total_params(m)
    rest = sum(v for k, v in ms.items() if k != "padding")
    assert rest == pytest.approx(16 * psi / 3 + ms["padding"])  # keys = formula + padding
    # DDP buckets: reverse registration order, at most bucket_mb MiB each
    small = memory.buckets(m, ParallelConfig(dp=2, bucket_mb=0.1))  # cap 26,214 elements
    assert sum(b.numel for b in small) == psi and max(b.numel for b in small) <= 26_214
    assert small[0].numel == 16_384 + 64  # head, final norm: the first grads backward makes


def test_seven_b_headline():
    m = preset("llama2-7b")
    assert memory.checkpoint_bytes(m) == 2 * 6_738_415_616  # 13.5 GB ("14 GB" for 7e9)
    assert 16 * params.total_params(m) > 96e9  # the training state does not fit one 96 GB card


# ------------------------------------------------------------------ activations


def test_activation_terms_hand_computed():
    m = replace(preset("llama2-7b"), seq_len=4096)
    par = ParallelConfig(precision="bf16")
    a = memory.layer_activations(m, par, 1, memory.ActivationOptions("flash"))
    s, h, f = 4096, 4096, 11008
    assert a["norms"] == s * 2 * (2 * 2 * h + 4)  # input, output, fp32 1/rms
    assert a["qkv"] == s * 2 * 3 * h
    assert a["softmax"] == s * 4 * 32 + 24  # + the kernel's RNG seed and offset
    assert a["mlp"] == s * 3 * 2 * f  # gate, up, product (silu recomputed)
    eager = memory.layer_activations(m, par, 1, memory.ActivationOptions(fused_norm=False))
    assert eager["norms"] == s * 2 * (8 * h + 2 * h + 4)
    mat = memory.layer_activations(m, par, 1, memory.ActivationOptions("materialised"))
    assert mat["softmax"] == s * 2 * 32 * s
    # tp divides the inner terms; sp also the norms; cp divides tokens
    t = memory.layer_activations(m, replace(par, tp=4), 1)
    assert t["mlp"] == a["mlp"] / 4 and t["norms"] == a["norms"]
    t = memory.layer_activations(m, replace(par, tp=4, sequence_parallel=True), 1)
    # sp: the column matmuls save the norm output's shard (re-gathered in backward), so every
    # norm tensor, the output included, is 1/tp
    assert t["norms"] == a["norms"] / 4 and "sp_inputs" not in t
    c = memory.layer_activations(m, replace(par, cp=2), 1)
    assert c["mlp"] == a["mlp"] / 2


def megatron_bytes_per_token(m, t: int) -> float:
    """Megatron-Core's saved bytes per token per Llama layer, bf16, SP, flash, no recompute
    (docs/ledger.md derives it): 12h/t + 4·d_kv/t + 6f/t."""
    return 12 * m.hidden / t + 4 * m.kv_heads * m.head_dim / t + 6 * m.ffn / t


@pytest.mark.parametrize("name,t", [("llama3-405b", 8), ("llama3-8b", 2), ("llama2-7b", 4)])
def test_layer_activations_match_megatron(name, t):
    """The ledger's per-layer bytes (bf16, SP, fused kernels) vs Megatron-Core's formula: within
    1 % (fived also keeps the fp32 1/rms and log-sum-exp, 8/t + 4a/t bytes per token)."""
    m = replace(preset(name), seq_len=8192)
    par = ParallelConfig(tp=t, sequence_parallel=True, precision="bf16")
    ours = sum(memory.layer_activations(m, par, 1, memory.FUSED).values()) / 8192
    meg = megatron_bytes_per_token(m, t)
    assert ours == pytest.approx(meg + (8 + 4 * m.heads) / t)
    assert ours / meg < 1.01


def test_pipeline_inflight_factor():
    p = ParallelConfig(pp=4, micro_batches=16)
    assert [memory.inflight_microbatches(p, r) for r in range(4)] == [4, 3, 2, 1]
    g = replace(p, schedule="gpipe")
    assert memory.inflight_microbatches(g, 0) == 16
    i = replace(p, schedule="interleaved", virtual_stages=2)
    assert memory.inflight_microbatches(i, 0) == pytest.approx(4 * (1 + 3 / (4 * 2)))
    assert memory.inflight_microbatches(ParallelConfig(pp=4, micro_batches=2), 0) == 2


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activations_match_saved_tensors(recompute):
    """fp32 one-rank forward: the ledger's activation bytes vs autograd's saved tensors."""
    torch = pytest.importorskip("torch")
    from fived.comm.ops import Traffic
    from fived.model import build_model
    from fived.parallel.parallelize import parallelize_parts
    from fived.ranks.grid import Grid
    from fived.train.activations import SavedTensors

    m = preset("tiny")
    par = ParallelConfig(recompute=recompute)
    grid = Grid.from_config(par).connect(Traffic())  # one rank: no process group needed
    (model,), _ = parallelize_parts(build_model(m, 1), grid, par)
    b = 2
    x = torch.randint(0, m.vocab, (b, m.seq_len))
    with SavedTensors(list(model.parameters())) as s:
        model(x, torch.arange(m.seq_len), x)
    pred = memory.activations(m, par, b)
    pred.pop("recompute_layer", None)  # backward-time transient of full recompute
    if recompute == "full":
        pred.pop("rope_tables")  # held by the checkpoint, not saved by autograd
    # stated tolerance: 1 % (the runtime also saves a 4-byte loss scalar)
    assert sum(pred.values()) == pytest.approx(s.bytes, rel=0.01)


# ------------------------------------------------------------------ compute


def test_compute_conventions():
    m = preset("llama2-7b")
    fwd = compute.forward_flops_per_token(m)
    assert compute.model_flops_per_token(m) == 3 * fwd
    attn = compute.attention_flops_per_token(m)
    assert attn == 4 * 32 * 4096 * 4096
    assert compute.forward_flops_per_token(m, causal=True) == fwd - attn / 2
    assert compute.recompute_flops_per_token(m, "full") == fwd
    assert compute.recompute_flops_per_token(m, "selective") == attn
    assert compute.training_flops(7e9, 1e12) == pytest.approx(4.2e22)


# ------------------------------------------------------------------ bubble


def test_bubble_hand_computed():
    assert bubble.bubble_fraction(ParallelConfig(pp=4, micro_batches=8)) == pytest.approx(3 / 11)
    assert bubble.bubble_ratio(ParallelConfig(pp=4, micro_batches=8)) == pytest.approx(3 / 8)
    i = ParallelConfig(pp=4, micro_batches=8, schedule="interleaved", virtual_stages=2)
    assert bubble.bubble_fraction(i) == pytest.approx(3 / 19)
    z = ParallelConfig(pp=4, micro_batches=8, schedule="zb-h1")
    assert bubble.bubble_ticks(z) == pytest.approx(1.0)
    assert bubble.bubble_fraction(ParallelConfig(dp=8)) == 0.0


# ------------------------------------------------------------------ traffic


def test_traffic_formulas():
    m = preset("llama2-7b")
    n = params.total_params(m)
    bf = dict(precision="bf16", grad_reduce_dtype="bf16")
    ddp = traffic.step_bytes(m, ParallelConfig(dp=8, **bf), 1)
    assert ddp == {"dense": bytes_sent("all_reduce", 2 * n, 8)}
    z3 = traffic.step_bytes(m, ParallelConfig(dp=8, zero=3, **bf), 1)
    # (3Ψ − Ψ_root)·(N−1)/N·P: the root (embedding, final norm, head) is gathered once, it stays
    # gathered from its forward to its backward
    root = (2 * m.vocab + 1) * m.hidden
    assert z3["dense"] == pytest.approx(7 / 8 * 2 * (3 * n - root))
    z1 = traffic.step_bytes(m, ParallelConfig(dp=8, zero=1, **bf), 1)
    assert z1["dense"] == pytest.approx(ddp["dense"])  # RS + AG = AR
    # TP: 4 all-reduces of b·s·h per layer; SP moves the same bytes
    par = ParallelConfig(tp=4, **bf)
    layer = [c for c in traffic.tp_traffic(m, par, 1) if "wo" in c.what or "attn" in c.what]
    x = 4096 * 4096 * 2
    assert sum(c.bytes for c in layer) == 32 * 4 * bytes_sent("all_reduce", x, 4)
    sp = replace(par, sequence_parallel=True)
    core = [c for c in traffic.tp_traffic(m, sp, 1) if c.what.startswith(("SP", "grad of SP"))]
    assert sum(c.bytes for c in core) == pytest.approx(sum(c.bytes for c in layer))
    # ... plus the backward re-gather of the column inputs saved as shards (attention, MLP)
    again = [c for c in traffic.tp_traffic(m, sp, 1) if c.what.startswith("re-gather of SP")]
    assert sum(c.bytes for c in again) == 32 * 2 * bytes_sent("all_gather", x, 4)
    # PP: first stage sends activations only, last stage grads only
    pp = ParallelConfig(pp=4, micro_batches=8, **bf)
    first, last = traffic.pp_traffic(m, pp, 1, 0), traffic.pp_traffic(m, pp, 1, 3)
    assert [c.phase for c in first] == ["fwd"] and [c.phase for c in last] == ["bwd"]
    assert traffic.bytes_by_group(first)["pp"] == 8 * x
    # CP ring: 3·(cp−1) hops of K+V per layer, in fp32 whatever the precision (the ring sends
    # fp32 K/V and dK/dV; the bf16 dry run found the ledger charging 2 bytes)
    cp = ParallelConfig(cp=2, **bf)
    kv = 4096 // 2 * 32 * 128 * 4
    assert traffic.bytes_by_group(traffic.cp_traffic(m, cp, 1))["cp"] == 32 * 3 * 1 * 2 * kv


# ------------------------------------------------------------------ planner


def test_planner_never_returns_a_layout_that_does_not_fit():
    m = preset("llama2-7b")
    hw = hardware.PRESETS["rtx-pro-6000"]
    res = planner.plan(m, 8, hw, 64, 8, micro_batch_sizes=(1, 2), recomputes=("none", "full"))
    assert res.ranked, res.counts
    for p in res.ranked:
        assert p.memory.total <= hw.memory * 0.9
        assert p.par.tp * p.par.cp <= 8
    assert res.counts["out_of_memory"] > 0  # e.g. plain DDP: 18Ψ does not fit
    # fastest first; layouts within planner.TIE of each other are ties (fewer bytes first)
    times = [p.step_seconds for p in res.ranked]
    assert all(later >= t / (1 + planner.TIE) for i, t in enumerate(times) for later in times[i:])
    assert res.reasons and "fits" in res.reasons[0]


def _plan_summary(res, top=10):
    counts = {k: v for k, v in res.counts.items() if k != "timed"}
    return ([(p.name(), p.optimizer, p.step_seconds, p.memory.total) for p in res.ranked[:top]],
            counts, res.smallest_unfit and (res.smallest_unfit.name(),
                                            res.smallest_unfit.memory.total), res.reasons)


def exhaustive(monkeypatch):
    """The planner with every shortcut off: no memory bound, no floor, every layout timed."""
    monkeypatch.setattr(planner, "states_floor", lambda *a, **k: 0.0)
    monkeypatch.setattr(planner, "memory_bound", lambda *a, **k: 0.0)
    monkeypatch.setattr(planner, "step_lower_bound", lambda *a, **k: 0.0)


@pytest.mark.parametrize("model,gpus,gpu", [
    ("mixtral-8x7b", 16, "h100-sxm"),  # some fit, most are dropped by the bounds
    ("llama3-70b", 8, "rtx-pro-6000"),  # none fits: the smallest is found over every layout
])
def test_planner_bounds_drop_only_what_cannot_fit_or_win(monkeypatch, model, gpus, gpu):
    """The search with its memory bounds and its step-time bound returns what the exhaustive
    one returns: the same first layouts, counts, reasons and smallest unfit layout."""
    m = preset(model)
    hw = hardware.PRESETS[gpu]
    space = dict(micro_batch_sizes=(1,), recomputes=("full",), zeros=(1, 3),
                 schedules=("1f1b",), optimizer=("adamw", "muon"))
    seen: list[tuple[int, int]] = []
    fast = planner.plan(m, gpus, hw, 32, 8, progress=lambda d, t: seen.append((d, t)), **space)
    exhaustive(monkeypatch)
    slow = planner.plan(m, gpus, hw, 32, 8, **space)
    assert _plan_summary(fast) == _plan_summary(slow)
    assert bool(fast.ranked) == (model == "mixtral-8x7b")
    n = fast.counts["evaluated"]
    assert seen[0] == (0, None) and seen[-1] == (n, n)
    costed = [d for d, t in seen if t is not None]
    assert costed[0] == 0 and costed == sorted(costed)


@pytest.mark.parametrize("model,gpus,top", [
    ("mixtral-8x7b", 24, 10),  # MoE: expert buckets, ZeRO-2/3 buffer replays (24: enough
    # layouts fit beside the grouped experts' working set for the bound to skip some)
    ("llama3-8b", 8, 3),
])
def test_plan_is_the_exhaustive_search_on_a_full_space(monkeypatch, model, gpus, top):
    """Every search dimension (ZeRO stages, recompute, 1F1B and interleaved, micro-batch
    sizes; every degree, ep too) on a small cluster: the bounded search times only some
    layouts, yet its top, counts and reasons are the exhaustive search's."""
    m = preset(model)
    hw = hardware.PRESETS["h100-sxm"]
    space = dict(micro_batch_sizes=(1, 2) if model == "llama3-8b" else (1,),
                 zeros=(0, 1, 2, 3) if model == "llama3-8b" else (2, 3),
                 recomputes=("none", "full"), top=top)
    fast = planner.plan(m, gpus, hw, 32, 8, **space)
    assert 0 < fast.counts["timed"] < fast.counts["fit"], fast.counts
    exhaustive(monkeypatch)
    slow = planner.plan(m, gpus, hw, 32, 8, **space)
    assert slow.counts["timed"] == slow.counts["fit"]
    assert _plan_summary(fast, top) == _plan_summary(slow, top)


def test_bounds_are_below_what_they_bound():
    """memory_bound <= the largest rank's step peak; step_lower_bound <= the predicted step."""
    from fived.ledger import peak

    m = preset("qwen3-30b-a3b")
    hw = hardware.PRESETS["h100-sxm"]
    for par in (ParallelConfig(tp=2, ep=4, pp=4, dp=2, zero=1, precision="bf16",
                               micro_batches=4),
                ParallelConfig(ep=8, pp=4, dp=2, zero=2, precision="bf16", virtual_stages=2,
                               schedule="interleaved", micro_batches=8, recompute="full"),
                ParallelConfig(tp=4, cp=2, dp=2, zero=3, precision="bf16", micro_batches=2,
                               recompute="selective")):
        gb = par.dp * par.ep * par.micro_batches * 2
        for opt in ("adamw", "muon"):
            b = 2
            mem = peak.largest_rank(m, par, b, planner.GPU_ACTIVATIONS, opt)
            assert 0 < planner.memory_bound(m, par, None, opt) <= mem.peak
            assert planner.memory_bound(m, par, None, opt) < planner.memory_bound(
                m, par, b, opt) <= mem.peak
            pr = planner.predict(m, par, hw, gb, 8, optimizer=opt)
            assert 0 < planner.step_lower_bound(m, par, hw, gb, mem) <= pr.step_seconds
    # ZeRO-1/2's fp8 gather keeps its fp8 weights in 1 + 2/N bytes: the states alone bound them
    from fived.ledger import memory

    for z in (1, 2):
        par = ParallelConfig(dp=8, zero=z, precision="bf16", fp8="tensorwise")
        assert 0 < planner.memory_bound(preset("llama3-8b"), par, None) <= sum(
            memory.model_states(preset("llama3-8b"), par).values())


@pytest.mark.parametrize("par", [
    ParallelConfig(tp=2, ep=4, pp=4, dp=2, zero=1, precision="bf16"),
    ParallelConfig(ep=8, pp=16, dp=2, zero=3, precision="bf16", virtual_stages=2,
                   schedule="interleaved", micro_batches=16),
    ParallelConfig(tp=4, pp=2, dp=2, zero=2, precision="bf16", micro_batches=4),
])
def test_states_floor_is_below_the_largest_rank(par):
    from fived.ledger import memory

    m = preset("qwen3-30b-a3b")
    for opt in ("adamw", "muon"):
        total = memory.largest_rank(m, par, 1, optimizer=opt).total
        floor = memory.states_floor(m, par, opt)
        assert 0 < floor <= total


def test_iron_rule_and_links():
    par = ParallelConfig(tp=8, dp=8)
    assert planner.inside_node(par, "tp", 8)
    assert not planner.inside_node(par, "dense", 8)
    assert not planner.inside_node(ParallelConfig(tp=16), "tp", 8)


def test_predict_mfu_bounded():
    m = preset("llama3-70b")
    hw = hardware.PRESETS["h100-sxm"]
    par = ParallelConfig(tp=8, pp=4, dp=2, zero=1, sequence_parallel=True, micro_batches=256,
                         precision="bf16")
    pr = planner.predict(m, par, hw, 512, 8)
    assert 0 < pr.mfu <= 0.7
    assert pr.step_seconds == pytest.approx(sum(pr.times.values()))


# ------------------------------------------------------------------ the runtime, measured


def test_ddp_runtime_memory_and_traffic_equal_the_ledger(tmp_path, capsys):
    from fived.cli import main
    from fived.ledger import verify
    from fived.testing import small_train, train_layout

    m = preset("tiny")
    par = ParallelConfig(dp=2)
    metrics = tmp_path / "m.jsonl"
    train = small_train(steps=2, metrics_out=str(metrics))
    out = train_layout(m, par, train)
    # what `fived train --metrics-out` wrote, checked by `fived ledger --check`
    assert verify.compare_file(m, par, train.global_batch, str(metrics)) == []
    # the file's first line records the run, so the file alone is enough
    assert verify.run_of_file(str(metrics)) == (m, par, train.global_batch)
    assert main(["ledger", "--check", str(metrics)]) == 0
    assert "exact" in capsys.readouterr().out
    # a file without the run record takes the layout from the flags: the run's own pass, and
    # bf16 (whose master weights and bf16 grads the fp32 run does not have) is caught
    lines = metrics.read_text().splitlines()
    first = json.loads(lines[0])
    del first["run"]
    bare = tmp_path / "bare.jsonl"
    bare.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    assert verify.run_of_file(str(bare)) is None
    assert main(["ledger", "--model", "tiny", "--gpus", "2", "--precision", "fp32",
                 "--global-batch", str(train.global_batch), "--check", str(bare)]) == 0
    assert "exact" in capsys.readouterr().out
    assert main(["ledger", "--model", "tiny", "--gpus", "2", "--precision", "bf16",
                 "--global-batch", str(train.global_batch), "--check", str(bare)]) == 1
    said = capsys.readouterr().out
    assert "memory[master]" in said and "--precision bf16" in said  # names the key and the cause
    b = traffic.micro_batch_size(par, train.global_batch)
    for s in out:
        last = s["history"][-1]
        assert last["memory"] == memory.model_states(m, par)
        assert last["traffic"] == traffic.step_bytes(m, par, b)
        for r, (mem, tr) in enumerate(zip(last["memory_per_rank"], last["traffic_per_rank"])):
            assert mem == memory.model_states(m, par), r
            assert tr["bytes"] == traffic.step_bytes(m, par, b), r


@pytest.mark.slow
def test_runtime_tied_micro_batches_equal_the_ledger():
    """A second layout the runtime runs: tied embeddings, 2 micro-batches, dp=2."""
    from fived.ledger import verify
    from fived.testing import small_train, train_layout

    m = replace(preset("tiny"), tied_embeddings=True)
    par = ParallelConfig(dp=2, micro_batches=2)
    train = small_train(steps=1)
    out = train_layout(m, par, train)
    for s in out:
        assert verify.compare_record(m, par, train.global_batch, s["history"][-1]) == []


def test_grid_coordinates_match_the_grid():
    from fived.ledger import verify
    from fived.ranks.grid import Grid

    par = ParallelConfig(tp=2, cp=2, ep=1, dp=2, pp=2)
    for r in range(par.world_size):
        g = Grid.from_config(par, r)
        assert verify.coords(par, r) == g.coords()
        assert verify.group_index(par, "dense", r) == g.members(("dp", "ep", "cp")).index(r)
        assert verify.group_index(par, "expert", r) == g.members(("dp", "cp")).index(r)


ZERO_LAYOUTS = [
    ParallelConfig(dp=2, zero=1),
    ParallelConfig(dp=2, zero=2, micro_batches=2),
    ParallelConfig(dp=3, zero=3),  # padding: 3 does not divide a block
    ParallelConfig(dp=2, zero=1, precision="bf16"),  # 18Ψ: fp32 grads, fp32 master
    ParallelConfig(dp=3, precision="bf16", grad_reduce_dtype="bf16", bucket_mb=0.05),
]


@pytest.mark.slow
@pytest.mark.parametrize("par", ZERO_LAYOUTS, ids=lambda p: f"{p.describe()}-{p.precision}")
def test_zero_and_precision_runtime_equal_the_ledger(par):
    """Runs where the ZeRO / mixed-precision engine is built (``-m slow``)."""
    from fived.ledger import verify
    from fived.testing import small_train, train_layout

    m = preset("tiny")
    train = small_train(steps=1, global_batch=6 if par.dp == 3 else 8)
    for s in train_layout(m, par, train):
        assert verify.compare_record(m, par, train.global_batch, s["history"][-1]) == []


TP_LAYOUTS = [
    ParallelConfig(tp=2, dp=2),
    ParallelConfig(tp=2, sequence_parallel=True, recompute="full"),
]


@pytest.mark.slow
@pytest.mark.parametrize("par", TP_LAYOUTS, ids=lambda p: f"{p.describe()}-{p.recompute}")
def test_tp_runtime_equal_the_ledger(par):
    """Where tensor parallelism is built (``-m slow``): memory and every group's bytes exact."""
    from fived.ledger import verify
    from fived.testing import small_train, train_layout

    m = preset("tiny")
    train = small_train(steps=1)
    for s in train_layout(m, par, train):
        assert verify.compare_record(m, par, train.global_batch, s["history"][-1]) == []


PP_LAYOUTS = [
    ParallelConfig(pp=2, micro_batches=2),
    ParallelConfig(pp=2, dp=2, micro_batches=4, schedule="interleaved", virtual_stages=2),
]


@pytest.mark.slow
@pytest.mark.parametrize("par", PP_LAYOUTS, ids=lambda p: f"{p.describe()}-{p.schedule}")
def test_pp_runtime_equal_the_ledger(par):
    """Where the pipeline is built (``-m slow``): every rank's states and bytes exact."""
    from fived.ledger import verify
    from fived.testing import small_train, train_layout

    m = preset("tiny")
    train = small_train(steps=1)
    for s in train_layout(m, par, train):
        assert verify.compare_record(m, par, train.global_batch, s["history"][-1]) == []


def test_balanced_split_puts_the_head_on_a_lighter_stage():
    m = preset("llama3-70b")
    assert params.balanced_split(m, 8) == (10, 10, 10, 10, 10, 10, 11, 9)
    assert sum(params.balanced_split(preset("llama3-405b"), 16)) == 126


EP_LAYOUTS = [ParallelConfig(ep=2), ParallelConfig(ep=2, dp=2), ParallelConfig(ep=2, cp=2),
              ParallelConfig(ep=2, tp=2), ParallelConfig(ep=2, tp=2, sequence_parallel=True),
              ParallelConfig(ep=2, tp=2, sequence_parallel=True, recompute="full")]


@pytest.mark.slow
@pytest.mark.parametrize("par", EP_LAYOUTS,
                         ids=lambda p: p.describe() + ("-recompute" if p.recompute == "full" else ""))
def test_ep_runtime_equal_the_ledger(par):
    """Where MoE is built (``-m slow``): states and every group's bytes exact on every rank; the
    ep all-to-all bytes are predicted from the routing the record carries (they follow the
    router), the MoE counts all-reduce over cp / SP-tp and the MoE block's single tp cut from
    the ledger's formulas."""
    from fived.ledger import verify
    from fived.testing import small_train, train_layout

    m = preset("tiny-moe")
    train = small_train(steps=1)
    rec = train_layout(m, par, train)[0]["history"][-1]
    assert verify.compare_record(m, par, train.global_batch, rec) == []
    # the routing really is uneven: the uniform expectation would not have matched
    uniform = verify.predict_rank(m, par, train.global_batch, 0)[1]["ep"]
    assert any(tr["bytes"]["ep"] != uniform for tr in rec["traffic_per_rank"])


CP_LAYOUTS = [ParallelConfig(cp=2), ParallelConfig(cp=2, recompute="selective"),
              ParallelConfig(cp=2, cp_mode="ulysses")]


@pytest.mark.slow
@pytest.mark.parametrize("par", CP_LAYOUTS, ids=lambda p: f"{p.cp_mode}-{p.recompute}")
def test_cp_runtime_equal_the_ledger(par):
    """Where context parallelism is built (``-m slow``): states and every group's bytes exact
    (selective recompute reruns the forward ring)."""
    from fived.ledger import verify
    from fived.testing import small_train, train_layout

    m = preset("tiny")
    train = small_train(steps=1)
    for s in train_layout(m, par, train):
        assert verify.compare_record(m, par, train.global_batch, s["history"][-1]) == []


def test_h800_is_an_h100_with_deepseeks_nvlink():
    """The `h800` preset (DeepSeek-V3's GPU): the H100's compute and memory, NVLink at the
    report's 160 GB/s. A layout whose traffic stays in one node is slower on it by its
    intra-node collectives alone; one GPU's step is the same."""
    h100, h800 = hardware.PRESETS["h100-sxm"], hardware.PRESETS["h800"]
    for f in ("peak_flops", "peak_fp8", "peak_fp32", "memory", "hbm_bw", "inter_bw", "gemm_eff"):
        assert getattr(h800, f) == getattr(h100, f), f
    assert h800.intra_bw == 160 * hardware.GB < h100.intra_bw
    m = preset("llama2-7b")
    one = ParallelConfig(precision="bf16", zero=3, dp=1)
    assert (planner.predict(m, one, h800, 8).step_seconds
            == planner.predict(m, one, h100, 8).step_seconds)
    tp8 = ParallelConfig(precision="bf16", tp=8)
    slow, fast = planner.predict(m, tp8, h800, 8), planner.predict(m, tp8, h100, 8)
    assert slow.step_seconds > fast.step_seconds
