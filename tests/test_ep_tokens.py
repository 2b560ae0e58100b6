"""The token dispatch (``ep_dispatch = tokens``, issue 29): one row per (token, ep rank).

* parity (dropless, fp32): node-limited routing with a gated shared expert at ep2 and ep4, and
  under ep2·tp2 with sequence parallelism, ep2·pp2, ep2·dp2 with ZeRO-1 and ZeRO-3, equal the
  one-rank reference (losses, grad norms, aux losses, routing, every first-step gradient);
* the bytes: each rank's measured ep bytes equal ``ep_routed_bytes`` on the recorded routing
  and rows per rank to the byte, no token reaches more ep ranks than ``ep_destinations_bound``,
  and the rows sent are fewer than the row dispatch's on the same routing;
* the plan on one process: the distinct (rank, token) pairs and each assignment's place;
* the dry run at the ledger's bound: states, traffic by op and activations equal the ledger's
  (activations to the byte at ep4, fp32 and bf16).

Mutations seen to fail here: the weights' gradient cut at the owner (parity), the weights'
backward bytes doubled in ``ep_routed_bytes`` (bytes), the 8D token indices left out of
``moe_routing_bytes_per_token`` (activations).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ParallelConfig, preset
from fived.ledger.memory import act_bytes
from fived.ledger.traffic import ep_destinations_bound, ep_routed_bytes
from fived.parallel.expert import token_plan
from fived.ranks.grid import Grid
from fived.testing import small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import SessionRuns, bad_moe_config_exits_2, check_moe_parity  # noqa: E402,I001

BASE = preset("qwen3-moe-tiny")
BOTH = replace(BASE, shared_expert=True, shared_expert_ffn=48, shared_expert_gate=True,
               route_groups=4, route_top_groups=2)
T = dict(ep_dispatch="tokens")
LAYOUTS4 = {
    "ep4": ParallelConfig(ep=4, **T),
    "ep2-tp2-sp": ParallelConfig(ep=2, tp=2, sequence_parallel=True, **T),
    "ep2-pp2": ParallelConfig(ep=2, pp=2, micro_batches=2, **T),
    "ep2-dp2-zero1": ParallelConfig(ep=2, dp=2, zero=1, **T),
    "ep2-dp2-zero3": ParallelConfig(ep=2, dp=2, zero=3, **T),
}
runs = SessionRuns()
one_rank = runs.one_rank


def predicted(m, par, moe):
    groups = Grid.from_config(par).partition(("ep",))
    return ep_routed_bytes(m, moe["counts"], groups, moe["forwards"], act_bytes(par),
                           par.recompute == "full", sent_rows=moe.get("sent_rows"))


# ------------------------------------------------------------------------ parity

def test_ep2_parity_and_bytes():
    """ep2, both dispatches on one routing: equal to the reference, the token dispatch's bytes
    exact and below the row dispatch's."""
    tok, rows = ParallelConfig(ep=2, **T), ParallelConfig(ep=2)
    a, b = runs([(BOTH, tok), (BOTH, rows)])
    ref = one_rank(BOTH)
    check_moe_parity(a, ref, "tokens")
    check_moe_parity(b, ref, "rows")
    for out, par in ((a, tok), (b, rows)):
        for step, h in enumerate(out["ranks"][0]["history"]):
            want = predicted(BOTH, par, h["moe"])
            got = [r["bytes"].get("ep", 0.0) for r in h["traffic_per_rank"]]
            assert got == want, (par.ep_dispatch, step, got, want)
    h_tok, h_rows = a["ranks"][0]["history"][0], b["ranks"][0]["history"][0]
    sent = sum(r["bytes"]["ep"] for r in h_tok["traffic_per_rank"])
    assert sent < 0.8 * sum(r["bytes"]["ep"] for r in h_rows["traffic_per_rank"])
    assert "sent_rows" not in h_rows["moe"]


@pytest.mark.slow
def test_world4_parity():
    pairs = [(BOTH, p) for p in LAYOUTS4.values()]
    for (m, p), out in zip(pairs, runs(pairs)):
        check_moe_parity(out, one_rank(m), p.describe())
        h = out["ranks"][0]["history"][-1]
        assert [r["bytes"].get("ep", 0.0) for r in h["traffic_per_rank"]] == predicted(m, p, h["moe"])


def test_rows_per_token_within_the_bound():
    """ep4 with 4 groups, the best 2: each token reaches at most 2 ranks, so in each layer a
    rank sends at most 2 token rows per token (its own rank's included) — and more than one on
    average (the recorded ``sent_rows`` of the first step)."""
    par = LAYOUTS4["ep4"]
    out = runs([(BOTH, par)])[0]
    bound = ep_destinations_bound(BOTH, par)
    assert bound == 2
    h = out["ranks"][0]["history"][0]
    tokens = small_train().global_batch * BOTH.seq_len // par.ep  # per rank per step
    for r, sent in enumerate(h["moe"]["sent_rows"]):
        for layer in sent:
            assert sum(layer) <= bound * tokens, (r, layer)
            assert sum(layer) > tokens, (r, layer)


# ------------------------------------------------------------------------ the plan

def test_token_plan():
    # 6 assignments sorted by expert over 4 experts, 2 ranks (experts 0,1 | 2,3), tokens 0..2
    tok = torch.tensor([0, 2, 0, 1, 2, 2])
    counts = torch.tensor([2, 1, 2, 1])  # rank 0 gets tokens 0,2,0 ; rank 1 gets 1,2,2
    u_tok, pos, _, a_splits, u_splits = token_plan(tok, counts, 2, 3)
    assert u_tok.tolist() == [0, 2, 1, 2]
    assert u_splits == [2, 2] and a_splits == [3, 3]
    assert pos.tolist() == [0, 1, 0, 0, 1, 1]


def test_bad_dispatch_exits_2(tmp_path):
    bad_moe_config_exits_2(tmp_path, "", "--ep-dispatch", "--ep-dispatch", "token")


# ------------------------------------------------------------------------ ledger at the bound

@pytest.mark.parametrize("par", [ParallelConfig(ep=4, **T),
                                 ParallelConfig(ep=2, tp=2, sequence_parallel=True, **T),
                                 ParallelConfig(ep=2, pp=2, micro_batches=2, recompute="full",
                                                **T)],
                         ids=["ep4", "ep2-tp2-sp", "ep2-pp2-full"])
def test_dry_run_matches_ledger(par):
    """At the ledger's bound (uniform routing over ep_destinations_bound ranks per token):
    states, activations and traffic by op of every distinct rank equal the ledger's."""
    from fived.config import TrainConfig
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    out = dry_run(BOTH, par, TrainConfig(global_batch=4), distinct_ranks(par), show=False)
    assert verify.compare_record(BOTH, par, 4, out) == []


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dry_run_activations_exact_ep4(precision):
    """The token dispatch's saved tensors (8k + 8D per token, ``moe_routing_bytes_per_token``)
    to the byte: the activation peak of every distinct rank equals the ledger's."""
    from fived.config import TrainConfig
    from fived.ledger.verify import predict_activations
    from fived.train.dryrun import distinct_ranks, dry_run

    par = ParallelConfig(ep=4, precision=precision, **T)
    ranks = distinct_ranks(par)
    out = dry_run(BOTH, par, TrainConfig(global_batch=4), ranks, show=False)
    peaks = out["activation_peak_per_rank"]
    for i, r in enumerate(ranks):
        got = peaks[i] if isinstance(peaks, list) else peaks[str(r)]
        assert got == predict_activations(BOTH, par, 4, r), (r, got)


# ------------------------------------------------------------------------ evaluation between steps

def test_evaluation_rows_stay_out_of_the_next_steps_record(tmp_path):
    """--eval-every 1 under the token dispatch: the evaluation's forwards dispatch rows too, and
    the step record after it must hold the step's own rows only, or ``ledger --check`` fails on
    it (the rows were once left out of the statistics the evaluation restores)."""
    from fived.data.meta import model_for_data
    from fived.data.prepare import Options, prepare
    from fived.ledger import verify
    from fived.testing import train_layout

    src = tmp_path / "in"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text("".join(f"def f{k}(x):\n    return x * {i + k}\n"
                                              for k in range(12)))
    prepare(Options((str(src),), str(tmp_path / "data"), val_fraction=0.3, workers=1),
            lambda s: None)
    model = model_for_data(BASE, str(tmp_path / "data"))
    par = ParallelConfig(ep=2, **T)
    metrics = tmp_path / "m.jsonl"
    train = small_train(steps=3, data=str(tmp_path / "data"), eval_every=1, eval_batches=1,
                        metrics_out=str(metrics))
    out = train_layout(model, par, train)
    assert all("val_loss" in h for h in out[0]["history"][:2]), out[0]["history"]
    assert verify.compare_file(model, par, train.global_batch, str(metrics)) == []
