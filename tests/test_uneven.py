"""Uneven pipeline splits: any pp·v ≤ layers works without --pp-layers, by the one balanced split
(``fived.ledger.params.balanced_split``) that the runtime's stage split, the ledger, the planner
and the dry run all use. Llama 3 405B's 126 layers over pp16 give one layer fewer on the first
and last stage (7, 8 × 14, 7), as published; with two virtual stages per rank 3, 4 × 30, 3."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fived.config import ConfigError, ParallelConfig, TrainConfig, preset, validate
from fived.ledger import params
from fived.parallel.pipeline.stage import partition

L405 = preset("llama3-405b")


def test_405b_over_pp16_is_llama3s_split():
    par = ParallelConfig(tp=8, pp=16, dp=64, micro_batches=16, sequence_parallel=True)
    validate(L405, par, TrainConfig(global_batch=1024), 8192)  # no --pp-layers needed
    sizes = [len(s) for s in partition(L405, par)]
    assert sizes == [7] + [8] * 14 + [7]
    assert params.stage_layers(L405, par) == partition(L405, par)  # ledger == runtime
    assert [params.rank_layers(L405, par, r) for r in range(16)] == sizes


def test_405b_interleaved_split():
    par = ParallelConfig(tp=8, pp=16, dp=64, schedule="interleaved", virtual_stages=2,
                         micro_batches=16)
    validate(L405, par, TrainConfig(global_batch=1024), 8192)
    sizes = [len(s) for s in partition(L405, par)]
    assert sizes == [3] + [4] * 30 + [3]
    assert params.stage_layers(L405, par) == partition(L405, par)
    # rank 0 holds virtual stages 0 and 16, rank 15 holds 15 and 31
    assert params.rank_layers(L405, par, 0) == 7 and params.rank_layers(L405, par, 15) == 7
    assert params.rank_layers(L405, par, 7) == 8


def test_uneven_small_split_and_too_many_stages():
    tiny = preset("tiny")  # 4 layers
    par = ParallelConfig(pp=3)
    validate(tiny, par, TrainConfig(global_batch=8), 3)
    sizes = [len(s) for s in partition(tiny, par)]
    assert sum(sizes) == 4 and len(sizes) == 3 and min(sizes) >= 1
    with pytest.raises(ConfigError, match="each stage needs a layer"):
        validate(tiny, ParallelConfig(pp=5), TrainConfig(global_batch=8), 5)


def test_ledger_cli_accepts_126_over_pp16(capsys):
    from fived.cli import main

    rc = main(["ledger", "--model", "llama3-405b", "--gpus", "8192", "--tp", "8", "--pp", "16",
               "--dp", "64", "--global-batch", "2048", "--micro-batches", "16",
               "--sequence-parallel", "--precision", "bf16", "--zero", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tp8·pp16·dp64" in out


def test_ledger_memory_follows_the_split():
    par = ParallelConfig(tp=8, pp=16, dp=64, micro_batches=16, sequence_parallel=True,
                         precision="bf16", zero=1)
    from fived.ledger.memory import activations, model_states

    first, mid = model_states(L405, par, 0), model_states(L405, par, 1)
    assert first["params"] != mid["params"]  # 7 layers + embedding vs 8 layers
    a1 = activations(L405, par, 1, 1)
    a2 = activations(replace(L405), par, 1, 2)
    assert a1["mlp"] / 8 == pytest.approx(a2["mlp"] / 8 * 15 / 14)  # in-flight 15 vs 14


def test_runtime_trains_an_uneven_split_like_one_rank(tmp_path):
    """tiny (4 layers) over pp3 with no --pp-layers, 3 gloo ranks: losses and gathered
    first-step gradients equal the one-rank run, and ledger --check is exact for the split."""
    from fived.ledger import verify
    from fived.testing import grad_rel_diff, rel_diff, small_train, train_with_grads

    tiny = preset("tiny")
    path = tmp_path / "pp3.jsonl"
    train = small_train(steps=2, global_batch=6, metrics_out=str(path))
    par = ParallelConfig(pp=3, micro_batches=3)
    ref_losses, ref_grads = train_with_grads(tiny, ParallelConfig(), replace(train, metrics_out=""))
    losses, grads = train_with_grads(tiny, par, train)
    assert rel_diff(losses, ref_losses) < 1e-5
    assert grad_rel_diff(grads, ref_grads) < 1e-5
    assert verify.compare_file(tiny, par, train.global_batch, str(path)) == []


@pytest.mark.slow
def test_plan_without_a_batch_grows_it_with_the_cluster(capsys):
    """No --global-batch: 8,192 GPUs plan for 2,048 sequences (16M tokens at 8K, Llama 3's
    batch), not the training default of 16 that would cap data parallelism at 16; pp16
    layouts (126 layers: an uneven split) are costed and among the reported."""
    import json

    from fived.cli import main

    rc = main(["plan", "--model", "llama3-405b", "--gpus", "8192", "--precision", "bf16",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["global_batch"] == 2048
    assert '"pp": 16' in json.dumps(out["ranked"] if "ranked" in out else out)
