"""``--eos-target ignore``: the EOS token's target (the next document's first token) leaves the
loss. Step 0's loss and every gradient equal documents run one by one with a cross-entropy,
written in the test, over the tokens whose input is not EOS (normalised by 1/(B·S), as every
loss), at one rank and at tp2+SP and cp2 ring (the skip bit rides on the targets through the
vocab-parallel loss and the cp shards), fp32, 1e-5; ``count`` (the default) is another loss.

Mutation seen to fail: ``mark_eos_targets`` marking nothing (the one-rank loss gap 3.2e-2)."""

from dataclasses import replace

import pytest
from doc_helpers import prepared, unpacked_reference
from parity_helpers import TOL, cli_exits_2, grad_rel_diff, one_rank, rel_diff, train_runs

from fived.config import ParallelConfig, preset, validate
from fived.data.meta import model_for_data
from fived.testing import small_train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data = prepared(tmp_path_factory.mktemp("eos"))
    model = model_for_data(preset("tiny"), data)
    train = small_train(steps=1, data=data, doc_mask=True, eos_target="ignore")
    return model, train, unpacked_reference(model, train, reset=False)


def check(out, ref, what):
    for s in out["ranks"]:
        d = rel_diff([s["losses"][0]], [ref["loss"]])
        assert d < TOL, (what, "loss", d, s["losses"][0], ref["loss"])
    g = grad_rel_diff(out["grads"], ref["grads"])
    assert g < TOL, (what, "gradients", g)


def test_one_rank_skips_the_eos_targets(setup):
    model, train, ref = setup
    check(one_rank(model, train), ref, "one rank")
    counted = one_rank(model, replace(train, eos_target="count"))
    assert rel_diff(counted["losses"][:1], [ref["loss"]]) > 1e-3  # count is another loss


def test_tp2_sp_cp2_and_pp2_skip_the_eos_targets(setup):
    """Time: three world-2 runs in one pool call, 10 s at load ~20."""
    model, train, ref = setup
    runs = [(model, ParallelConfig(tp=2, sequence_parallel=True), train),
            (model, ParallelConfig(cp=2), train),
            (model, ParallelConfig(pp=2, micro_batches=2), train)]
    for _, p, t in runs:
        validate(model, p, t, 2)
    for (_, p, _), out in zip(runs, train_runs(runs, timeout=600)):
        check(out, ref, p.describe())


def test_eos_target_without_data_exits_2(tmp_path):
    cli_exits_2(["train", "--eos-target", "ignore", "--nprocs", "1", "--steps", "1",
                 "--metrics-out", str(tmp_path / "m")], "--eos-target", tmp_path / "m")
