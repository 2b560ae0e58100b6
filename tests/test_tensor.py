"""Tensor (+ sequence) parallelism: parity with one rank, traffic == formula, SP activations.

Layouts that share a world size train in one spawn (``_train_many``) to keep the default suite
short; the full matrix (tp ∈ {2, 4} × SP × dp × ZeRO) is under ``-m slow``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fived.config import ParallelConfig, preset
from fived.parallel.tensor import tp_traffic_bytes
from fived.testing import rel_diff, run_ranks, small_train

MODEL = preset("tiny")  # heads 4, kv_heads 2: tp=4 replicates the kv heads
TIED = replace(MODEL, tied_embeddings=True)
TRAIN = small_train()


def _train_many(rank: int, world: int, runs: list) -> list:
    from fived.train.trainer import train_rank

    return [train_rank(rank, world, m, p, TRAIN, show=False) for m, p in runs]


def train_many(runs: list) -> list[list[dict]]:
    """[(model, par)] of one world size -> per run, every rank's summary."""
    world = runs[0][1].world_size
    assert all(p.world_size == world for _, p in runs)
    per_rank = run_ranks(_train_many, world, runs, timeout=600)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(runs))]


@pytest.fixture(scope="module")
def reference():
    ref, tied = train_many([(MODEL, ParallelConfig()), (TIED, ParallelConfig())])
    return {False: ref[0], True: tied[0]}


def check_parity(out: list[dict], ref: dict) -> None:
    assert len(ref["losses"]) >= 5
    for s in out:
        assert rel_diff(s["losses"], ref["losses"]) < 1e-5, (s["losses"], ref["losses"])
        norms = [h["grad_norm"] for h in s["history"]]
        assert rel_diff(norms, [h["grad_norm"] for h in ref["history"]]) < 1e-5


def check_traffic(out: list[dict], model, par: ParallelConfig) -> None:
    micro = TRAIN.global_batch // (par.dp * par.ep) // par.micro_batches
    want = sum(tp_traffic_bytes(model, par, micro).values())
    for s in out:
        for rank_traffic in s["history"][-1]["traffic_per_rank"]:
            assert rank_traffic["bytes"]["tp"] == want
        assert s["history"][-1]["traffic"]["tp"] == want


WORLD2 = [  # overlap (the default) and the plain copy_to/gather_from regions (--no-overlap)
    (MODEL, ParallelConfig(tp=2)),
    (MODEL, ParallelConfig(tp=2, sequence_parallel=True, overlap=False)),
    (TIED, ParallelConfig(tp=2, sequence_parallel=True)),
]


def _world2(rank: int, world: int) -> dict:
    """Everything the default suite checks on 2 ranks, in one spawn."""
    return {"loss": _loss_grads(rank, world), "activations": _activations(rank, world),
            "runs": _train_many(rank, world, WORLD2)}


@pytest.fixture(scope="module")
def world2():
    per_rank = run_ranks(_world2, 2, timeout=600)
    return {"loss": [r["loss"] for r in per_rank],
            "activations": [r["activations"] for r in per_rank],
            "runs": [[r["runs"][i] for r in per_rank] for i in range(len(WORLD2))]}


def test_tp2_alone_sp_and_tied(reference, world2):
    for (model, par), out in zip(WORLD2, world2["runs"]):
        check_parity(out, reference[model.tied_embeddings])
        check_traffic(out, model, par)


def test_tp4_gqa_replicated_kv_and_dp2_tp2(reference):
    """tp=4 > kv_heads=2: each kv chunk on 2 ranks, replica gradients summed; and dp=2 × tp=2."""
    runs = [
        (MODEL, ParallelConfig(tp=4, sequence_parallel=True)),
        (MODEL, ParallelConfig(dp=2, tp=2, sequence_parallel=True)),
    ]
    for (model, par), out in zip(runs, train_many(runs)):
        check_parity(out, reference[False])
        check_traffic(out, model, par)


def test_traffic_formula_by_hand():
    """The formula written out for tiny (b=8, s=64, h=64, fp32, 4 layers) at tp=2."""
    a = 8 * 64 * 64 * 4  # one activation, bytes; an all-reduce over 2 ranks sends A
    loss = 512 * 4 + 2 * 512 * 4  # max, then (sum-exp, target logit), per token
    assert tp_traffic_bytes(MODEL, ParallelConfig(tp=2), 8) == {
        "all_reduce": 4 * 4 * a + a + a + loss}  # blocks, embedding, head
    sp = tp_traffic_bytes(MODEL, ParallelConfig(tp=2, sequence_parallel=True), 8)
    assert sp == {"all_gather": (4 * 4 + 2) * a / 2, "reduce_scatter": (4 * 4 + 2) * a / 2,
                  "all_reduce": loss + 9 * 64 * 4}  # + the 9 norm weights' gradients


# ------------------------------------------------------------------ SP activation memory


def _activations(rank: int, world: int) -> dict:
    from fived.comm.ops import Traffic
    from fived.dist.grid import Grid
    from fived.model import build_model
    from fived.parallel.plan import Plan
    from fived.train.activations import SavedTensors

    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(Traffic())
    x = torch.randint(0, MODEL.vocab, (2, MODEL.seq_len), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(MODEL.seq_len)
    out = {}
    for sp in (False, True):
        plan = Plan(MODEL, ParallelConfig(tp=world, sequence_parallel=sp), 7, grid)
        model = build_model(MODEL, plan)
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
    for per_rank in world2["activations"]:
        plain, sp = per_rank[False], per_rank[True]
        assert plain["norms"] == 2 * MODEL.layers + 1
        assert sp["norm"] * 2 == plain["norm"]
        assert sp["total"] < plain["total"]


@pytest.mark.slow
def test_sp_norm_activations_tp4():
    for per_rank in run_ranks(_activations, 4):
        assert per_rank[True]["norm"] * 4 == per_rank[False]["norm"]


# ------------------------------------------------------------------ vocab-parallel loss


def _loss_grads(rank: int, world: int) -> bool:
    import torch.nn.functional as F

    from fived.comm.ops import Traffic
    from fived.dist.grid import Grid
    from fived.parallel.tensor import vocab_parallel_loss

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
        check_parity(out, reference[model.tied_embeddings])
        check_traffic(out, model, par)


@pytest.mark.slow
def test_zero_dp2_tp2(reference):
    """dp=2 × tp=2 under ZeRO-1/2/3, with and without SP (one spawn)."""
    for (model, par), out in zip(ZERO, train_many(ZERO)):
        check_parity(out, reference[False])
        check_traffic(out, model, par)


@pytest.mark.slow
def test_bench_tp_runs(capsys):
    from fived.bench import tp

    assert tp.main(["--model", "tiny", "--reps", "1", "--warmup", "0", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "fived/DTensor" in out and "tp+sp" in out
