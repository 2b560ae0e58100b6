"""Tensor (+ sequence) parallelism: parity with one rank (losses and every parameter's gathered
first-step gradient), traffic == formula, SP activations.

Layouts that share a world size train in one spawn (``train_runs``) to keep the default suite
short; the full matrix (tp ∈ {2, 4} × SP × dp × ZeRO) is under ``-m slow``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ParallelConfig, preset
from fived.parallel.tensor import tp_traffic_bytes
from fived.testing import grad_pieces, grad_rel_diff, rel_diff, run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import rank_runs, check_parity as _check, gathered, one_rank, train_runs  # noqa: E402,I001

MODEL = preset("tiny")  # heads 4, kv_heads 2: tp=4 replicates the kv heads
TIED = replace(MODEL, tied_embeddings=True)
TRAIN = small_train()


def train_many(runs: list) -> list[dict]:
    """[(model, par)] of one world size -> per run, every rank's summary and the gradients."""
    return train_runs([(m, p, TRAIN) for m, p in runs])


@pytest.fixture(scope="module")
def reference():
    return {False: one_rank(MODEL, TRAIN), True: one_rank(TIED, TRAIN)}


def check_parity(out: dict, ref: dict, what=None) -> None:
    """Every rank's losses and grad norms over 5 steps, and the first step's gradients."""
    assert len(ref["losses"]) >= 5
    _check(out, ref, what)
    ref_norms = [h["grad_norm"] for h in ref["ranks"][0]["history"]]
    for s in out["ranks"]:
        assert rel_diff([h["grad_norm"] for h in s["history"]], ref_norms) < 1e-5, what


def check_traffic(out: dict, model, par: ParallelConfig) -> None:
    micro = TRAIN.global_batch // (par.dp * par.ep) // par.micro_batches
    want = sum(tp_traffic_bytes(model, par, micro).values())
    for s in out["ranks"]:
        for rank_traffic in s["history"][-1]["traffic_per_rank"]:
            assert rank_traffic["bytes"]["tp"] == want
        assert s["history"][-1]["traffic"]["tp"] == want


WORLD2 = [  # overlap (the default) and --no-overlap (copy_to; SP: the region, waited at once)
    (MODEL, ParallelConfig(tp=2)),
    (MODEL, ParallelConfig(tp=2, sequence_parallel=True, overlap=False)),
    (TIED, ParallelConfig(tp=2, sequence_parallel=True)),
]


def _world2(rank: int, world: int) -> dict:
    """Everything the default suite checks on 2 ranks, in one spawn."""
    return {"loss": _loss_grads(rank, world), "activations": _activations(rank, world),
            "runs": rank_runs(rank, world, [(m, p, TRAIN) for m, p in WORLD2])}


@pytest.fixture(scope="module")
def world2():
    per_rank = run_ranks(_world2, 2, timeout=600)
    return {"loss": [r["loss"] for r in per_rank],
            "activations": [r["activations"] for r in per_rank],
            "runs": [gathered([r["runs"][i] for r in per_rank]) for i in range(len(WORLD2))]}


def test_tp2_alone_sp_and_tied(reference, world2):
    for (model, par), out in zip(WORLD2, world2["runs"]):
        check_parity(out, reference[model.tied_embeddings], par)
        check_traffic(out, model, par)


def _perturbed_reference(model, train, factor: float) -> dict:
    """The one-rank run with every norm weight's gradient multiplied by ``factor`` inside the
    backward (a tensor hook on the leaf): a wrong gradient that really drives the optimizer."""
    from fived.train.trainer import Trainer

    torch.manual_seed(train.seed)
    tr = Trainer(model, ParallelConfig(), train, 0, 1)
    hooked = [p.register_hook(lambda g: g * factor) for n, p in tr.stage.named_parameters()
              if n.endswith("norm.weight")]
    assert len(hooked) == 2 * model.layers + 1
    grads: dict = {}
    recs = [tr.step(k, (lambda: grads.update(grad_pieces(tr))) if k == 0 else None)
            for k in range(train.steps)]
    return gathered([{"losses": [r["loss"] for r in recs], "grads": grads}])


def test_gradient_check_catches_what_the_losses_miss(reference, world2):
    """The gradient comparison has teeth: a reference whose norm-weight gradients are 1e-3
    relative too large — applied in its backward, so it trains on them — still has the same
    losses (AdamW's update m/√v is invariant to a per-parameter gradient scale, so the loss
    curve cannot show it), yet the gathered gradients of the tp2+sp run differ from it by
    ~1e-3 on exactly the norm weights. Even a factor 2 (the classic SP bug: norm gradients
    summed over tp twice) moves the 5 losses by less than the 1e-5 tolerance."""
    (_, par), out = WORLD2[1], world2["runs"][1]
    assert par.sequence_parallel and par.tp == 2  # the norms' gradients are summed over tp
    norms = {n for n in out["grads"] if n.endswith("norm.weight")}
    assert len(norms) == 2 * MODEL.layers + 1
    for factor in (1 + 1e-3, 2.0):
        bad = _perturbed_reference(MODEL, TRAIN, factor)
        for s in out["ranks"]:  # the losses alone would pass it ...
            assert rel_diff(s["losses"], bad["losses"]) < 1e-5, factor
        d = grad_rel_diff(out["grads"], bad["grads"])  # ... the gradients do not
        want = (factor - 1) / factor
        assert abs(d - want) < 0.01 * want, (factor, d)
        wrong = {n for n in bad["grads"]
                 if grad_rel_diff({n: out["grads"][n]}, {n: bad["grads"][n]}) > 1e-5}
        assert wrong == norms, sorted(wrong ^ norms)
    assert grad_rel_diff(out["grads"], reference[False]["grads"]) < 1e-5


def test_tp4_gqa_replicated_kv_and_dp2_tp2(reference):
    """tp=4 > kv_heads=2: each kv chunk on 2 ranks, replica gradients summed; and dp=2 × tp=2."""
    runs = [
        (MODEL, ParallelConfig(tp=4, sequence_parallel=True)),
        (MODEL, ParallelConfig(dp=2, tp=2, sequence_parallel=True)),
    ]
    for (model, par), out in zip(runs, train_many(runs)):
        check_parity(out, reference[False], par)
        check_traffic(out, model, par)


def test_traffic_formula_by_hand():
    """The formula written out for tiny (b=8, s=64, h=64, fp32, 4 layers) at tp=2."""
    a = 8 * 64 * 64 * 4  # one activation, bytes; an all-reduce over 2 ranks sends A
    loss = 512 * 4 + 2 * 512 * 4  # max, then (sum-exp, target logit), per token
    assert tp_traffic_bytes(MODEL, ParallelConfig(tp=2), 8) == {
        "all_reduce": 4 * 4 * a + a + a + loss}  # blocks, embedding, head
    sp = tp_traffic_bytes(MODEL, ParallelConfig(tp=2, sequence_parallel=True), 8)
    # SP: per block 2 gathers forward, 2 backward (grad of the scatters) and 2 re-gathers of the
    # column inputs saved as shards; embedding 1 backward; head 1 forward + 1 re-gather
    assert sp == {"all_gather": (4 * 6 + 3) * a / 2, "reduce_scatter": (4 * 4 + 2) * a / 2,
                  "all_reduce": loss + 9 * 64 * 4}  # + the 9 norm weights' gradients


# ------------------------------------------------------------------ SP activation memory


def _activations(rank: int, world: int) -> dict:
    from fived.comm.ops import Traffic
    from fived.model import build_model
    from fived.parallel.parallelize import parallelize_parts
    from fived.ranks.grid import Grid
    from fived.train.activations import SavedTensors

    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(Traffic())
    x = torch.randint(0, MODEL.vocab, (2, MODEL.seq_len), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(MODEL.seq_len)
    out = {}
    for sp in (False, True):
        parts, _ = parallelize_parts(build_model(MODEL, 7), grid,
                                     ParallelConfig(tp=world, sequence_parallel=sp))
        (model,) = parts
        norms = [m for n, m in model.named_modules() if n.endswith("norm")]
        rec: dict[str, SavedTensors] = {}

        def pre(mod, args, rec=rec, model=model):
            rec[id(mod)] = SavedTensors(exclude=list(model.parameters())).__enter__()

        def post(mod, args, output, rec=rec):
            rec[id(mod)].__exit__(None, None, None)

        with SavedTensors(exclude=list(model.parameters())) as total:
            model(x, pos, x).backward()
        hooks = [m.register_forward_pre_hook(pre) for m in norms]
        hooks += [m.register_forward_hook(post) for m in norms]
        model(x, pos, x).backward()
        for h in hooks:
            h.remove()
        out[sp] = {"norm": sum(s.bytes for s in rec.values()), "total": total.bytes,
                   "norms": len(norms)}
    return out


def test_sp_norm_activations_are_one_over_tp(world2):
    from fived.ledger.memory import activations

    for per_rank in world2["activations"]:
        plain, sp = per_rank[False], per_rank[True]
        assert plain["norms"] == 2 * MODEL.layers + 1
        assert sp["norm"] * 2 == plain["norm"]
        assert sp["total"] < plain["total"]
        # the ledger to the byte, bar the loss's scalars and bool mask (256 B here): under SP the
        # column matmuls save the sequence shard (a whole-sequence save: +32 KiB per region)
        for on in (False, True):
            pred = sum(activations(MODEL, ParallelConfig(tp=2, sequence_parallel=on), 2).values())
            assert 0 <= per_rank[on]["total"] - pred <= 512


@pytest.mark.slow
def test_sp_norm_activations_tp4():
    for per_rank in run_ranks(_activations, 4):
        assert per_rank[True]["norm"] * 4 == per_rank[False]["norm"]


# ------------------------------------------------------------------ vocab-parallel loss


def _loss_grads(rank: int, world: int) -> bool:
    import torch.nn.functional as F

    from fived.comm.ops import Traffic
    from fived.parallel.tensor import vocab_parallel_loss
    from fived.ranks.grid import Grid

    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(Traffic())
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 5, 16, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, 16, (2, 5), generator=g)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    local = logits.detach().chunk(world, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_loss(local, targets, grid["tp"])
    loss.backward()
    want = F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten(), reduction="sum")
    assert torch.allclose(loss, want, rtol=1e-6)
    assert torch.allclose(local.grad, logits.grad.chunk(world, -1)[rank], atol=1e-6)
    assert set(grid.groups["tp"].traffic.bytes_by_dim()) == {"tp"}
    return True


def test_vocab_parallel_loss_matches_cross_entropy(world2):
    assert all(world2["loss"])


# ------------------------------------------------------------------ the full matrix


SLOW_2 = [
    (MODEL, ParallelConfig(tp=2, micro_batches=2)),
    (MODEL, ParallelConfig(tp=2, overlap=False)),
    (MODEL, ParallelConfig(tp=2, sequence_parallel=True, recompute="full", overlap=False)),
    (TIED, ParallelConfig(tp=2)),
    (MODEL, ParallelConfig(tp=2, recompute="full")),
    (MODEL, ParallelConfig(tp=2, sequence_parallel=True, recompute="full")),
]
SLOW_4 = [
    (MODEL, ParallelConfig(tp=4)),
    (TIED, ParallelConfig(tp=4, sequence_parallel=True)),
    (MODEL, ParallelConfig(dp=2, tp=2)),
    (MODEL, ParallelConfig(dp=2, tp=2, micro_batches=2, sequence_parallel=True)),
    (MODEL, ParallelConfig(tp=4, sequence_parallel=True, overlap=False)),
]
ZERO = [
    (MODEL, ParallelConfig(dp=2, tp=2, zero=z, sequence_parallel=sp))
    for z in (1, 2, 3) for sp in (False, True)
]


@pytest.mark.slow
@pytest.mark.parametrize("runs", [SLOW_2, SLOW_4], ids=["world2", "world4"])
def test_full_matrix(reference, runs):
    for (model, par), out in zip(runs, train_many(runs)):
        check_parity(out, reference[model.tied_embeddings], par)
        check_traffic(out, model, par)


@pytest.mark.slow
def test_zero_dp2_tp2(reference):
    """dp=2 × tp=2 under ZeRO-1/2/3, with and without SP (one spawn)."""
    for (model, par), out in zip(ZERO, train_many(ZERO)):
        check_parity(out, reference[False], par)
        check_traffic(out, model, par)


@pytest.mark.slow
def test_bench_tp_runs(capsys):
    from fived.bench import tp

    assert tp.main(["--model", "tiny", "--reps", "1", "--warmup", "0", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "fived/DTensor" in out and "tp+sp" in out
