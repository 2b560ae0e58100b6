"""``--eos-target ignore``: the EOS token's target (the next document's first token) leaves the
loss. Step 0's loss and every gradient equal documents run one by one with a cross-entropy,
written in the test, over the tokens whose input is not EOS (normalised by 1/(B·S), as every
loss), at one rank and at tp2+SP and cp2 ring (the skip bit rides on the targets through the
vocab-parallel loss and the cp shards), fp32, 1e-5; ``count`` (the default) is another loss.

Mutations seen to fail: ``mark_eos_targets`` marking nothing (the one-rank loss gap 3.2e-2);
the skip wrapped outside a mixture's per-source split (the kept tokens then form one row:
``code``'s loss 10.70 against 5.43)."""

from dataclasses import replace

import pytest
from doc_helpers import prepared, source_rows, unpacked_reference
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


def test_a_mixture_skips_the_eos_targets_source_by_source(tmp_path):
    """A mixture with ``--eos-target ignore``: both marks ride on the targets (the row's source
    above bit 32, the skip bit 2³¹), and step 0's loss of each source equals a cross-entropy
    over that source's rows' non-EOS inputs, recomputed here from the initial weights; the
    row-weighted sources give the step's loss.

    Time: one one-rank step (~3 s at load ~20)."""
    import torch
    import torch.nn.functional as F

    from fived.data.loader import open_loader
    from fived.data.vocab import mask_padded_logits
    from fived.model.llama import build_model

    a, b = prepared(tmp_path / "a"), prepared(tmp_path / "b", seed=5, long=30)
    spec = f"code={a}:0.5,web={b}:0.5"
    model = model_for_data(preset("tiny"), spec)
    train = small_train(steps=1, data=spec, doc_mask=True, eos_target="ignore")
    rec = one_rank(model, train)["ranks"][0]["history"][0]
    ld = open_loader(spec, "train", seq_len=model.seq_len, batch=train.global_batch,
                     seed=train.seed, documents=True)
    x, y, docs = ld.global_batch(0)
    net = build_model(model, train.seed)
    mask_padded_logits(net, ld.data.vocab, model.vocab)
    total, seen = 0.0, 0
    for _, name, rows, pos, targets in source_rows(x, y, docs, model.seq_len, ["code", "web"]):
        with torch.no_grad():
            logits = net(x[rows], pos)[..., :ld.data.vocab]
            keep = x[rows] != ld.data.eos
            ce = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
        want = float(ce) / (len(rows) * model.seq_len)
        got = rec["loss_by_source"][name]
        assert abs(got - want) < 1e-5 * want, (name, got, want)
        total += want * len(rows)
        seen += 1
    assert seen == 2
    assert abs(total / len(y) - rec["loss"]) < 1e-5 * rec["loss"]
