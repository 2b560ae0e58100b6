"""MoE routing options (issue 29): ``norm_topk_prob``, ``router`` = softmax | sigmoid,
``first_dense_layers``, ``balance`` = aux_loss | bias.

* parity (dropless, fp32): each option at ep2, ep2·tp2, ep2·pp2, ep2·dp2 with ZeRO-1 and ZeRO-3
  equals the one-rank reference over 5 steps — every rank's losses, grad norms, aux losses,
  routing and every parameter's gathered first-step gradient (``check_parity``). The default
  suite runs one spawn per world size: every option alone at ep2 (world 2), and one model with
  all of them at once under the four world-4 layouts; ``-m slow`` runs the full matrix;
* the routing formulas on one token (softmax/sigmoid, renormalised or not);
* bad input: one clear message naming the field, exit 2, before any rank starts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.model import build_model
from fived.model.moe import moe_layers, route_scores

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import SessionRuns, bad_moe_config_exits_2, check_moe_parity  # noqa: E402,I001

BASE = preset("qwen3-moe-tiny")
MODELS = {
    "no-renorm": replace(BASE, norm_topk_prob=False),
    "sigmoid": replace(BASE, router="sigmoid"),
    "first-dense": replace(BASE, first_dense_layers=1),
}
ALL = replace(BASE, router="sigmoid", norm_topk_prob=False, first_dense_layers=1)
LAYOUTS4 = {
    "ep2-tp2": ParallelConfig(ep=2, tp=2),
    "ep2-pp2": ParallelConfig(ep=2, pp=2, micro_batches=2),
    "ep2-dp2-zero1": ParallelConfig(ep=2, dp=2, zero=1),
    "ep2-dp2-zero3": ParallelConfig(ep=2, dp=2, zero=3),
}

runs = SessionRuns()
one_rank = runs.one_rank


def check(model, par, out):
    check_moe_parity(out, one_rank(model), (model, par.describe()))


# ------------------------------------------------------------------------ parity (default)

def test_each_option_ep2_parity():
    pairs = [(m, ParallelConfig(ep=2)) for m in MODELS.values()]
    for (m, p), out in zip(pairs, runs(pairs)):
        check(m, p, out)


def test_all_options_world4_parity():
    pairs = [(ALL, p) for p in LAYOUTS4.values()]
    for (m, p), out in zip(pairs, runs(pairs)):
        check(m, p, out)


# ------------------------------------------------------------------------ parity (slow matrix)

@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS4))
@pytest.mark.parametrize("name", list(MODELS))
def test_option_parity_matrix(name, layout):
    m, p = MODELS[name], LAYOUTS4[layout]
    pairs = [(MODELS[n], LAYOUTS4[q]) for n in MODELS for q in LAYOUTS4]  # one spawn for all
    runs(pairs)
    check(m, p, runs([(m, p)])[0])


# ------------------------------------------------------------------------ routing formulas

@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
def test_routing_weights_formula(router, norm):
    cfg = replace(BASE, router=router, norm_topk_prob=norm)
    torch.manual_seed(0)
    logits = torch.randn(5, cfg.experts)
    scores, probs = route_scores(cfg, logits)
    want = logits.softmax(-1) if router == "softmax" else torch.sigmoid(logits)
    assert torch.equal(scores, want)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    moe = moe_layers(build_model(cfg, 7))[0]
    top_i = moe.select(scores, cfg.top_k)
    assert torch.equal(top_i, want.topk(cfg.top_k, -1).indices)


def test_first_dense_layers_blocks_are_dense():
    net = build_model(replace(BASE, first_dense_layers=2), 7)
    names = {n for n, _ in net.named_parameters()}
    assert "layers.0.mlp.gate_proj.weight" in names and "layers.1.mlp.down_proj.weight" in names
    assert not any(n.startswith(("layers.0.block_sparse_moe", "layers.1.block_sparse_moe"))
                   for n in names)
    assert [m.layer for m in moe_layers(net)] == list(range(2, BASE.layers))
    assert net.layers["0"].mlp.gate_proj.weight.shape == (BASE.ffn, BASE.hidden)


# ------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("body,field", [
    ("top_k = 9", "top_k"),
    ("experts = 5", "experts over --ep 2"),  # 5 experts cannot split over ep 2
    ('router = "relu"', "router"),
    ('balance = "none"', "balance"),
    ("first_dense_layers = 4", "first_dense_layers"),
    ("bias_update_rate = -0.1", "bias_update_rate"),
])
def test_bad_routing_config_exits_2(tmp_path, body, field):
    bad_moe_config_exits_2(tmp_path, body, field)


def test_validate_names_first_dense_layers():
    with pytest.raises(ConfigError, match="first_dense_layers"):
        validate(replace(BASE, first_dense_layers=BASE.layers), ParallelConfig())


# ------------------------------------------------------------------------ ledger exactness

@pytest.mark.parametrize("par", [ParallelConfig(ep=2, tp=2),
                                 ParallelConfig(ep=2, pp=2, micro_batches=2),
                                 ParallelConfig(ep=2, dp=2, zero=3)],
                         ids=["ep2-tp2", "ep2-pp2", "ep2-dp2-zero3"])
def test_first_dense_layers_dry_run_matches_ledger(par):
    """States, activations and traffic of every distinct rank equal the ledger's exactly."""
    from fived.config import TrainConfig
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    m = replace(BASE, first_dense_layers=1, router="sigmoid", norm_topk_prob=False)
    out = dry_run(m, par, TrainConfig(global_batch=4), distinct_ranks(par), show=False)
    assert verify.compare_record(m, par, 4, out) == []


def test_first_dense_layers_ledger_counts():
    from fived.ledger.params import active_params, param_counts, param_list

    m = replace(BASE, first_dense_layers=1)
    net = build_model(m, 7)
    c = param_counts(m)
    assert c["total"] == sum(p.numel() for p in net.parameters())
    assert c["expert"] == sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    names = [n for n, _, _ in param_list(m, ParallelConfig())]
    assert names == [n for n, _ in net.named_parameters()]
    dense = sum(p.numel() for n, p in net.named_parameters() if ".experts." not in n)
    assert active_params(m) == dense + (m.layers - 1) * m.top_k * 3 * m.hidden * m.expert_ffn
