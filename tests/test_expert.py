"""Mixture of experts and expert parallelism (issue 8).

* parity (dropless, fp32): ep ∈ {2, 4}, top-1 and top-2, alone and with dp=2, tp=2, pp=2, equal
  to the one-rank run to 1e-5 relative over 5 steps — losses, grad norms, aux losses, routing,
  and every parameter's gathered first-step gradient;
* the aux losses: injected gradient == autograd of the explicit total; layout-independent value;
* capacity: dropped assignments == a direct count on the one-rank run, and the same under ep;
* ledger: each rank's expert-parameter bytes and its ep all-to-all bytes equal the formulas in
  ``fived.parallel.expert`` exactly (measured ``history[-1]["traffic_per_rank"][r]["ep"]``).

The default set keeps to tiny-moe and a handful of spawned runs; ``-m slow`` runs the matrix.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ParallelConfig, TrainConfig, preset
from fived.ledger.params import expert_param_bytes
from fived.ledger.traffic import bytes_by_group, ep_routed_bytes, ep_traffic, micro_batch_size
from fived.model import build_model
from fived.model.moe import capacity, capacity_keep, moe_layers, set_aux_grad_scale
from fived.parallel.parallelize import parallelize_parts
from fived.ranks.grid import Grid
from fived.testing import assemble_grads, grad_pieces, grad_rel_diff, rel_diff, small_train
from fived.train import data

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import (  # noqa: E402,I001
    check_moe_parity, check_parity as _check, offline_grid, one_rank as _one_rank, train_runs)

TOP2 = preset("tiny-moe")
TOP1 = replace(TOP2, top_k=1)
MODELS = {1: TOP1, 2: TOP2}

_cache: dict = {}


def run(top_k: int, par: ParallelConfig, train: TrainConfig | None = None, model=None):
    """Train once per (model, layout, run) per test session: every rank's summary
    (``["ranks"]``) and the gathered first-step gradients (``["grads"]``)."""
    model = model or MODELS[top_k]
    train = train or small_train()
    key = (model, par, train)
    if key not in _cache:
        _cache[key] = train_runs([(model, par, train)])[0]
    return _cache[key]


def one_rank(top_k: int, model=None, train: TrainConfig | None = None):
    """The one-rank reference, in this process, computed once per (model, run)."""
    model = model or MODELS[top_k]
    train = train or small_train()
    key = ("one", model, train)
    if key not in _cache:
        _cache[key] = _one_rank(model, train)
    return _cache[key]


def check_parity(top_k: int, par: ParallelConfig) -> None:
    ref = one_rank(top_k)
    out = run(top_k, par)
    assert len(ref["losses"]) >= 5
    # every rank's losses, every parameter's first-step gradient, the per-step MoE numbers
    check_moe_parity(out, ref, par)


# ------------------------------------------------------------------------ parity (default)

@pytest.mark.parametrize("top_k,par", [
    (2, ParallelConfig(ep=2)),
    (1, ParallelConfig(ep=4)),
    (2, ParallelConfig(ep=2, dp=2, micro_batches=2)),
], ids=["top2-ep2", "top1-ep4", "top2-ep2-dp2-mb2"])
def test_ep_parity(top_k, par):
    check_parity(top_k, par)


def test_ep_tp_parity():
    check_parity(2, ParallelConfig(ep=2, tp=2))


def test_ep_pp_parity():
    check_parity(2, ParallelConfig(ep=2, pp=2, micro_batches=2))


def test_ep_zero1_parity():
    check_parity(2, ParallelConfig(ep=2, dp=2, zero=1))


# ------------------------------------------------------------------------ parity (slow matrix)

EXTRA = {"alone": {}, "dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2, "micro_batches": 2}}


@pytest.mark.slow
@pytest.mark.parametrize("extra", list(EXTRA))
@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("top_k", [1, 2])
def test_ep_parity_matrix(top_k, ep, extra):
    check_parity(top_k, ParallelConfig(ep=ep, **EXTRA[extra]))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_ep_zero_parity(zero):
    check_parity(2, ParallelConfig(ep=2, dp=2, zero=zero))


@pytest.mark.slow
def test_ep_sequence_parallel_parity():
    """With SP the MoE gathers the sequence over tp, so routing and aux losses are exact."""
    check_parity(2, ParallelConfig(ep=2, tp=2, sequence_parallel=True))


@pytest.mark.slow
def test_ep_cp_parity_dropless():
    """cp shards each sequence: the balance loss sums the routed counts over cp (exact)."""
    check_parity(2, ParallelConfig(ep=2, cp=2))


# ------------------------------------------------------------------------ model-level checks

def _rank_model(model_cfg, par: ParallelConfig, rank: int):
    """This rank's (pp = 1) model and placements, built as the trainer builds them, in this
    process (cutting a model talks to no one)."""
    parts, placements = parallelize_parts(build_model(model_cfg, 7), offline_grid(par, rank), par)
    (model,) = parts
    return model, placements


def test_parameter_names_do_not_depend_on_ep():
    full = dict(build_model(TOP2, 7).named_parameters())
    assert any(n.endswith("block_sparse_moe.experts.3.w2.weight") for n in full)
    union: dict[str, torch.Tensor] = {}
    for par in (ParallelConfig(), ParallelConfig(ep=4)):
        for r in range(par.ep):
            model, placements = _rank_model(TOP2, par, r)
            params = dict(model.named_parameters())
            assert set(params) == set(placements)
            for n, p in params.items():
                assert n in full
                assert torch.equal(p, full[n])  # same init on any layout
                pl = placements[n]
                assert (pl.name, pl.shape, pl.parts, pl.grad_sum) == (n, tuple(p.shape), 1, ())
                if ".experts." in n:  # routed experts: reduced over dp·cp only, with any ep
                    assert pl.grad_group == "expert", n
                    e = int(n.split(".experts.")[1].split(".")[0])
                    assert e // (TOP2.experts // par.ep) == r  # contiguous blocks of experts
                    if par.ep > 1:
                        assert n not in union
                else:
                    assert pl.grad_group == "dense", n
                if par.ep > 1:
                    union[n] = p
            moes = moe_layers(model)
            assert len(moes) == TOP2.layers
            assert all((m.dispatch is None) == (par.ep == 1) for m in moes)
    assert set(union) == set(full)


def _batch(model, step=0, batch=4):
    x, y = data.global_batch(step, 7, batch, model.seq_len)
    return x, y, torch.arange(model.seq_len)


@pytest.mark.parametrize("shared", [False, True])
def test_aux_gradient_injection_equals_explicit_total(shared):
    """Trainer convention: backward of CE·scale, aux losses injected with
    ``set_aux_grad_scale(model, scale)`` (each MoE layer's ``aux_grad_scale``).
    Must equal autograd of CE·scale + Σ_layers aux_local·scale (aux_local = coef·seq_len·ΣB +
    coef_z·Σz², i.e. coef·ΣB/global_sequences + coef_z·Σz²/global_tokens after the scale)."""
    cfg = replace(TOP2, shared_expert=shared, aux_loss_coef=0.3, z_loss_coef=0.05)
    x, y, pos = _batch(cfg)
    scale = 1.0 / x.numel()
    grads = []
    for inject in (True, False):
        model = build_model(cfg, 7)
        set_aux_grad_scale(model, scale if inject else 0.0)
        for m in moe_layers(model):
            assert m.aux_grad_scale == (scale if inject else 0.0)
            m.keep_aux = True
        loss = model(x, pos, y) * scale
        if not inject:
            loss = loss + scale * sum(m.last_aux for m in moe_layers(model))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-9, msg=n)
    router = [n for n in grads[0] if n.endswith("block_sparse_moe.gate.weight")]
    assert len(router) == cfg.layers and all(grads[0][n].abs().sum() > 0 for n in router)


def test_balance_loss_is_one_when_uniform():
    """B = E·Σ f·P is exactly 1 per sequence when the router probabilities are uniform."""
    cfg = replace(TOP2, layers=1)
    model = build_model(cfg, 7)
    moe = moe_layers(model)[0]
    with torch.no_grad():
        moe.gate.weight.zero_()
    x = torch.randn(2, 8, cfg.hidden)
    moe(x)
    # zero router: p uniform (1/E); top-k picks the first k experts: f = 1/k on k experts
    assert math.isclose(moe.stats.balance_sum, 2 * cfg.experts * (cfg.top_k * (1 / cfg.top_k) / cfg.experts))


def test_capacity_keep_priority():
    # one sequence, 4 tokens, k=2, 2 experts, capacity 2: first choices first, then positions
    top = torch.tensor([[[0, 1], [0, 1], [0, 1], [1, 0]]])
    keep = capacity_keep(top, 2, 2)
    # expert 0 first choices: tokens 0, 1, 2 -> 0, 1 kept; expert 1 first choice: token 3
    # second choices: expert 1 from tokens 0, 1, 2 -> only token 0 fits; expert 0 from 3: full
    assert keep.tolist() == [[[True, True], [True, False], [False, False], [True, False]]]
    assert capacity(replace(TOP2, capacity_factor=1.0), 64) == math.ceil(64 * 2 / 4)


# ------------------------------------------------------------------------ dropped tokens

CAP = replace(TOP2, capacity_factor=1.0)


def test_dropped_tokens_match_direct_count_and_ep():
    """The one-rank run's dropped assignments == a direct count from the router inputs
    (Σ_seq Σ_e max(0, n_{seq,e} − C)); ep=2 drops exactly the same and keeps parity (losses and
    first-step gradients)."""
    from fived.train.trainer import Trainer

    train = small_train()
    tr = Trainer(CAP, ParallelConfig(), train, 0, 1)
    direct = {"dropped": 0, "kept": torch.zeros(CAP.layers, CAP.experts, dtype=torch.long)}

    def hook(mod, args):
        (x,) = args
        logits = x.float().reshape(-1, x.shape[-1]) @ mod.gate.weight.float().t()
        top = logits.topk(CAP.top_k, dim=-1).indices.view(x.shape[0], -1)
        cap = math.ceil(CAP.capacity_factor * x.shape[1] * CAP.top_k / CAP.experts)
        for seq in top:
            n = torch.bincount(seq, minlength=CAP.experts)
            direct["dropped"] += int((n - cap).clamp(min=0).sum())
            direct["kept"][mod.layer] += n.clamp(max=cap)

    for m in moe_layers(tr.stage):
        m.register_forward_pre_hook(hook)
    ref, grads = [], {}
    for step in range(train.steps):
        direct["dropped"] = 0
        direct["kept"].zero_()
        rec = tr.step(step, (lambda: grads.update(grad_pieces(tr))) if step == 0 else None)
        assert rec["moe"]["dropped"] == direct["dropped"] > 0
        assert rec["moe"]["tokens_per_expert"] == direct["kept"].tolist()
        ref.append(rec)
    out = run(2, ParallelConfig(ep=2), model=CAP)
    for s in out["ranks"]:
        assert [h["moe"]["dropped"] for h in s["history"]] == [r["moe"]["dropped"] for r in ref]
        assert rel_diff(s["losses"], [r["loss"] for r in ref]) < 1e-5
    assert grad_rel_diff(out["grads"], assemble_grads([grads])) < 1e-5


# ------------------------------------------------------------------------ ledger

@pytest.mark.parametrize("par", [ParallelConfig(ep=2), ParallelConfig(ep=2, dp=2, micro_batches=2),
                                 ParallelConfig(ep=2, tp=2),
                                 ParallelConfig(ep=2, pp=2, micro_batches=2),
                                 pytest.param(ParallelConfig(ep=2, recompute="full"),
                                              marks=pytest.mark.slow)],
                         ids=["ep2", "ep2-dp2-mb2", "ep2-tp2", "ep2-pp2", "ep2-recompute"])
def test_expert_and_all_to_all_bytes_equal_formula(par):
    out = run(2, par)
    grid = Grid.from_config(par)
    ep_groups = grid.partition(("ep",))
    layers_on_rank = TOP2.layers // par.pp
    forwards = [layers_on_rank * par.micro_batches] * par.world_size
    ref_params = one_rank(2)["ranks"][0]["history"][-1]["memory"]["params"]
    for s in out["ranks"]:
        for h in s["history"]:
            moe = h["moe"]
            assert moe["forwards"] == forwards
            predicted = ep_routed_bytes(TOP2, moe["counts"], ep_groups, forwards,
                                        recompute_full=par.recompute == "full")
            measured = [t["bytes"].get("ep", 0.0) for t in h["traffic_per_rank"]]
            assert measured == predicted
            want = expert_param_bytes(TOP2, par.ep, layers_on_rank)
            assert moe["expert_param_bytes"] == [want] * par.world_size
            all_experts = expert_param_bytes(TOP2, 1)
            for mem in h["memory_per_rank"]:
                if par.pp == 1 and par.tp == 1:
                    assert mem["params"] == ref_params - all_experts + want
    if par.recompute == "full":  # stats are not re-counted by the recompute; parity holds
        _check(out, one_rank(2), par)
        return
    # the balanced-routing estimate is the right order of magnitude (routing is uneven)
    mb = micro_batch_size(par, small_train().global_batch)
    est = bytes_by_group(ep_traffic(TOP2, par, mb))["ep"]
    assert 0.3 < out["ranks"][0]["history"][-1]["traffic"]["ep"] / est < 3


def test_expert_bytes_formula_values():
    m = preset("mixtral-8x7b")
    # 32 layers · 8 experts · 3 · 4096 · 14336 · 2 bytes (bf16) = 90.2 GB; ep=8: one expert each
    assert expert_param_bytes(m, 1, dtype_bytes=2) == 32 * 8 * 3 * 4096 * 14336 * 2
    assert expert_param_bytes(m, 8, dtype_bytes=2) * 8 == expert_param_bytes(m, 1, dtype_bytes=2)


# ------------------------------------------------------------------------ observability

def test_jsonl_and_display_carry_moe_stats(tmp_path, capsys):
    from fived.train.trainer import train_rank

    path = tmp_path / "m.jsonl"
    train_rank(0, 1, TOP2, ParallelConfig(), small_train(steps=2, metrics_out=str(path)),
               show=True)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        moe = r["moe"]
        assert len(moe["tokens_per_expert"]) == TOP2.layers
        routed = small_train().global_batch * TOP2.seq_len * TOP2.top_k
        assert all(sum(layer) == routed for layer in moe["tokens_per_expert"])
        assert moe["dropped"] == 0
        assert moe["aux_loss"] > 0 and moe["z_loss"] > 0
        assert 0.0 <= moe["a2a_share"] <= 1.0
    shown = capsys.readouterr().out
    assert "tokens/expert%" in shown and "all-to-all share" in shown


# ------------------------------------------------------------------------ dispatch edge cases

def _dispatch_rank(rank: int, world: int) -> list[float]:
    from fived.comm.ops import Traffic

    par = ParallelConfig(ep=world)
    grid = Grid.from_config(par, rank).connect(Traffic())
    parts, _ = parallelize_parts(build_model(TOP2, 7), grid, par)
    moe = moe_layers(parts[0])[0]  # this rank's experts; dispatch over grid["ep"]
    full = moe_layers(build_model(TOP2, 7))[0]
    assert moe.local_experts == [2 * rank, 2 * rank + 1]
    E, h = TOP2.experts, TOP2.hidden
    cases = {  # counts per expert this rank sends: uneven, all-remote, nothing at all
        "uneven": [3, 0, 5, 1] if rank == 0 else [0, 2, 0, 7],
        "remote": [0, 0, 6, 2] if rank == 0 else [4, 1, 0, 0],
        "empty": [0, 0, 0, 0] if rank == 0 else [1, 0, 2, 0],
    }
    errs = []
    for counts in cases.values():
        gen = torch.Generator().manual_seed(100 + rank)
        rows = torch.randn(sum(counts), h, generator=gen)
        a, b = rows.clone().requires_grad_(True), rows.clone().requires_grad_(True)
        y = moe.dispatch(a, torch.tensor(counts), moe.compute_local)
        ref = full.compute_local(b, counts)
        (y * y).sum().backward()
        (ref * ref).sum().backward()
        errs.append(float((y - ref).abs().max()) if y.numel() else 0.0)
        errs.append(float((a.grad - b.grad).abs().max()) if a.numel() else 0.0)
        assert y.shape == (sum(counts), h)
    assert E == 4
    return errs


def test_dispatch_uneven_and_empty_splits():
    from fived.testing import run_ranks

    for errs in run_ranks(_dispatch_rank, 2):
        assert max(errs) < 1e-5, errs
