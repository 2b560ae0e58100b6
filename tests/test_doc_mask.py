"""Document masks (``--doc-mask``): a packed, masked batch equals its documents run one by
one, unpacked — step 0's loss and every parameter's gradient, fp32, 1e-5 — at one rank,
tp2+SP, cp2 ring, cp2 Ulysses, pp2 and a 3-D layout, and the pieces (the varlen core against
a dense masked softmax, the ring's chunk-pair plan, the loader's document ids).

Mutations seen to fail (issue 41): the batch run without the mask (gradient gap 0.43, checked
in the one-rank test); ``doc_plan`` not masking the diagonal chunk pair causally (cp2 ring loss
gap 8e-4); ``_merge_safe`` replaced by ``_merge`` in the ring (NaN: "replicas differ"); the
loader's ids shifted by one token (``test_loader_ids_follow_the_offsets``)."""

from dataclasses import replace

import pytest
import torch
from doc_helpers import prepared, unpacked_reference
from parity_helpers import TOL, grad_rel_diff, one_rank, rel_diff, train_runs, worst_params

from fived.config import ParallelConfig, preset, validate
from fived.data.meta import model_for_data
from fived.testing import small_train


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def setup(data_dir):
    model = model_for_data(preset("tiny"), data_dir)
    train = small_train(steps=2, data=data_dir, doc_mask=True, eval_every=2, eval_batches=1)
    return model, train, unpacked_reference(model, train, reset=False)


def check_unpacked(out, ref, what="", val=None):
    """Step 0's loss and gradients equal the unpacked documents'; with ``val`` (the one-rank
    masked run's), every rank's validation losses equal it (evaluation masks too)."""
    for s in out["ranks"]:
        d = rel_diff([s["losses"][0]], [ref["loss"]])
        assert d < TOL, (what, "loss", d, s["losses"][0], ref["loss"])
        if val is not None:
            assert rel_diff([v for _, v in s["val"]], val) < TOL, (what, s["val"], val)
    g = grad_rel_diff(out["grads"], ref["grads"])
    assert g < TOL, (what, "gradients", g, worst_params(out["grads"], ref["grads"]))
    return g


def val_of(out):
    return [v for _, v in out["ranks"][0]["val"]]


def test_one_rank_equals_documents_run_unpacked(setup):
    model, train, ref = setup
    assert ref["documents"] > 2 * train.global_batch  # windows hold several documents
    out = one_rank(model, train)
    check_unpacked(out, ref, "one rank")
    # without the mask the same batch is another computation (the test can fail)
    plain = one_rank(model, replace(train, doc_mask=False))
    assert grad_rel_diff(plain["grads"], ref["grads"]) > 1e-2
    assert rel_diff(val_of(plain), val_of(out)) > 1e-3  # the evaluation is masked too


def test_reset_positions_equal_the_unpacked_documents_from_zero(setup):
    """RoPE is relative: within a document, reset and continued positions give the same
    attention (up to rounding); both equal the unpacked documents run from position 0."""
    model, train, _ = setup
    t = replace(train, doc_positions="reset")
    check_unpacked(one_rank(model, t), unpacked_reference(model, t, reset=True), "reset")


LAYOUTS = [ParallelConfig(tp=2, sequence_parallel=True), ParallelConfig(cp=2),
           ParallelConfig(cp=2, cp_mode="ulysses"), ParallelConfig(pp=2, micro_batches=2)]


def test_world2_layouts_equal_documents_run_unpacked(setup):
    """tp2+SP, cp2 ring, cp2 Ulysses, pp2 (two micro-batches), and cp2 ring sharded by
    ``--cp-balance ptrr``, in one pool call.

    Time: five world-2 layouts in one pool call: 11 s on a quiet machine, 61 s under load."""
    model, train, ref = setup
    runs = [(model, p, train) for p in LAYOUTS]
    runs.append((model, ParallelConfig(cp=2), replace(train, cp_balance="ptrr")))
    for _, p, t in runs:
        validate(model, p, t, 2)
    outs = train_runs(runs, timeout=600)
    val = val_of(one_rank(model, train))
    for (_, p, t), out in zip(runs, outs):
        check_unpacked(out, ref, f"{p.describe()} {p.cp_mode} {t.cp_balance}", val)


def test_multi_token_prediction_stays_in_each_document(data_dir):
    """Multi-token prediction with document masks: module k's target counts only where the
    position k ahead is in the token's own document (``fived.model.mtp.inside_of``), so a
    packed, masked batch equals its documents run one by one, each with its modules
    truncated at its end — the objective (the trunk's loss + λ/D · Σ the modules') and every
    gradient, at one rank and cp2 (the targets ahead fetched across the zigzag chunks).
    Mutation seen to fail: the document test dropped from ``inside_of`` (the modules read and
    predict across documents)."""
    model = replace(model_for_data(preset("tiny"), data_dir), mtp_depth=2)
    train = small_train(steps=1, data=data_dir, doc_mask=True)
    ref = unpacked_reference(model, train, reset=False)
    outs = [one_rank(model, train), *train_runs([(model, ParallelConfig(cp=2), train)],
                                                timeout=600)]
    w = model.mtp_loss_weight / model.mtp_depth
    for what, out in zip(("one rank", "cp2"), outs):
        for s in out["ranks"]:
            first = s["history"][0]
            objective = first["loss"] + w * sum(first["mtp_losses"])
            assert rel_diff([objective], [ref["loss"]]) < TOL, (what, objective, ref["loss"])
        g = grad_rel_diff(out["grads"], ref["grads"])
        assert g < TOL, (what, g, worst_params(out["grads"], ref["grads"]))


def test_ptrr_deals_blocks_as_the_torch_free_rule():
    """The runtime's ``ptrr_chunks`` and the ledger's ``token_ranks`` agree token for token,
    every rank holds S/cp tokens, and the balance beats zigzag's on a skewed row."""
    from fived.ledger.context import rank_work, token_ranks
    from fived.parallel.context import balanced_positions

    lengths = [5, 3, 40, 2, 1, 60, 17, 100]  # 228 tokens: cut to 224 = 8·cp·14
    lengths[-1] -= 4
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    n = 2
    want = token_ranks(lengths, n, "ptrr")
    for r in range(n):
        pos = balanced_positions(docs, n, r)[0].tolist()
        assert len(pos) == 224 // n and all(want[t] == r for t in pos)
    ptrr = rank_work(lengths, want, n)
    zig = rank_work(lengths, token_ranks(lengths, n, "zigzag"), n)
    assert max(ptrr) / min(ptrr) < max(zig) / min(zig)


def test_3d_layout_equals_documents_run_unpacked(setup):
    """Eight ranks: pp2 · cp2 ring · tp2 with SP, selective recompute."""
    model, train, ref = setup
    p = ParallelConfig(pp=2, cp=2, tp=2, sequence_parallel=True, micro_batches=2,
                       recompute="selective")
    validate(model, p, train, 8)
    check_unpacked(train_runs([(model, p, train)], timeout=900)[0], ref, p.describe(),
                   val_of(one_rank(model, train)))


# ------------------------------------------------------------------------------ the pieces
def dense_reference(q, k, v, docs):
    """softmax over a materialised same-document causal mask, in float64."""
    from fived.model.documents import doc_mask

    s = q.shape[1]
    pos = torch.arange(s)
    m = doc_mask(pos, pos, docs)  # (b, s, s)
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    sc = torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5
    sc = sc.masked_fill(~m[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", sc.softmax(-1), vv)


def test_varlen_core_equals_a_dense_masked_softmax():
    from fived.model.layers import doc_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 20, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 20, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 8, [4] * 20, [7] * 1 + [8] * 12 + [9] * 7])
    torch.testing.assert_close(doc_attention(q, k, v, docs), dense_reference(q, k, v, docs))


def test_ring_plan_skips_pairs_wholly_in_other_documents():
    from fived.parallel.context import doc_plan

    c = 4  # cp2 zigzag: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    r0, r1 = torch.tensor([[0, 3]]), torch.tensor([[1, 2]])
    one_doc = torch.zeros(1, 16, dtype=torch.long)
    per_chunk = torch.arange(16).div(4, rounding_mode="floor")[None]  # a document per chunk
    assert len(doc_plan(r0, r0, c, one_doc)) == 3  # 0-0, 3-0, 3-3: the causal pairs
    assert [j for _, j, _ in doc_plan(r0, r0, c, per_chunk)] == [0, 1]  # the diagonals
    assert [j for _, j, _ in doc_plan(r0, r1, c, per_chunk)] == []  # all skipped


def test_loader_ids_follow_the_offsets(data_dir):
    from fived.data.loader import Loader
    from fived.data.shards import DataDir

    data = DataDir(data_dir)
    ld = Loader(data, "train", 64, 4, 7, documents=True)
    x, _, docs = ld.global_batch(0)
    offs = data.documents("train")
    for r, k in enumerate(ld.sequence_ids(0).tolist()):
        for t in range(64):
            d = int(docs[r, t])
            assert offs[d] <= k * 64 + t < offs[d + 1]
        # a document ends at its EOS: a new id starts right after each EOS of the window
        eos = (x[r, :-1] == data.eos).nonzero().flatten()
        assert (docs[r, eos + 1] == docs[r, eos] + 1).all()


def test_doc_mask_without_data_exits_2(tmp_path):
    from parity_helpers import cli_exits_2

    cli_exits_2(["train", "--doc-mask", "--nprocs", "1", "--steps", "1", "--metrics-out",
                 str(tmp_path / "m")], "--doc-mask", tmp_path / "m")


def test_dry_run_doc_mask_bad_input_exits_2(data_dir, tmp_path):
    """Without --doc-len, with a length < 1 or an unprepared directory, and --doc-len without
    the masked dry run: one message naming the flag, nothing written."""
    from parity_helpers import cli_exits_2

    m = tmp_path / "m"
    dry = ["train", "--dry-run", "--doc-mask", "--metrics-out", str(m)]
    cli_exits_2(dry, "--doc-len", m)
    cli_exits_2(dry + ["--doc-len", "0"], "--doc-len 0", m)
    cli_exits_2(dry + ["--doc-len", str(tmp_path / "none")], "--doc-len", m)
    cli_exits_2(["train", "--data", data_dir, "--doc-mask", "--doc-len", "8", "--nprocs", "1",
                 "--metrics-out", str(m)], "--doc-len 8", m)


DRY_LAYOUTS = [ParallelConfig(), ParallelConfig(tp=2, sequence_parallel=True),
               ParallelConfig(cp=2)]
DRY_LAYOUTS_SLOW = [ParallelConfig(cp=2, cp_mode="ulysses"), ParallelConfig(dp=2, zero=3),
                    ParallelConfig(cp=4, tp=2, sequence_parallel=True),
                    ParallelConfig(pp=2, micro_batches=2, recompute="selective"),
                    ParallelConfig(tp=2, pp=2, micro_batches=2)]


def dry_masked(tmp_path, par, doc_len, data_dir):
    """A --doc-mask dry run of ``tiny`` (documents of ``doc_len`` tokens, or ``data_dir``'s)
    checked by the ledger: states, traffic per group and (group, op) exact, the activation
    peak within ``ledger --check``'s tolerance, with the masks' terms."""
    from fived.config import TrainConfig
    from fived.ledger.verify import compare_record
    from fived.train.dryrun import distinct_ranks, dry_run

    m = preset("tiny")
    spec = data_dir if doc_len == "data" else doc_len
    train = TrainConfig(global_batch=8, doc_mask=True, doc_len=spec)
    validate(m, par, train, par.world_size)
    out = dry_run(m, par, train, distinct_ranks(par), out_path=str(tmp_path / "d.jsonl"),
                  show=False)
    assert out["run"]["doc_mask"] is True
    assert compare_record(m, par, 8, out, doc_mask=True) == [], par.describe()
    return m, train, out


@pytest.mark.parametrize("par", DRY_LAYOUTS, ids=lambda p: p.describe())
def test_the_dry_run_masks_documents_and_the_ledger_checks_it(tmp_path, data_dir, par):
    """``fived train --dry-run --doc-mask --doc-len N|DIR``: the masked attention on fake
    tensors (the varlen core's segments and the ring's chunk-pair plan from the host ids),
    ``ledger --check`` exact with the masks' saved bytes; on one rank the step peak too, and
    the ledger without the masks' terms misses the measured activation peak (the dry run ran
    the masked core).

    Time (load ~20): one rank 3-5 s, tp2+SP 7-8 s, cp2 ring 4-5 s."""
    from fived.ledger.verify import check_peak, compare_record, peak_rows

    m, train, out = dry_masked(tmp_path, par, "24" if par.tp == 1 else "data", data_dir)
    if par.world_size == 1:
        assert compare_record(m, par, 8, out), "the masks' bytes were not measured"
        assert not check_peak(peak_rows(m, par, 8, out, doc_mask=True))


@pytest.mark.slow
@pytest.mark.parametrize("par", DRY_LAYOUTS_SLOW, ids=lambda p: p.describe())
def test_the_dry_run_masks_documents_in_more_layouts(tmp_path, data_dir, par):
    """Ulysses, ZeRO-3, cp4 ring · tp2+SP, pp2 with selective recompute, tp2·pp2, cp2 ring
    with ``--cp-balance ptrr``: as the fast test."""
    dry_masked(tmp_path, par, "24", data_dir)


@pytest.mark.slow
def test_the_dry_run_masks_documents_under_ptrr(tmp_path, data_dir):
    from fived.config import TrainConfig
    from fived.ledger.verify import compare_record
    from fived.train.dryrun import distinct_ranks, dry_run

    m, par = preset("tiny"), ParallelConfig(cp=2)
    train = TrainConfig(global_batch=8, doc_mask=True, doc_len="24", cp_balance="ptrr")
    out = dry_run(m, par, train, distinct_ranks(par), show=False)
    assert compare_record(m, par, 8, out, doc_mask=True) == []


def test_cp_balance_needs_doc_mask_and_ring(data_dir, tmp_path):
    from parity_helpers import cli_exits_2

    m = tmp_path / "m"
    cli_exits_2(["train", "--data", data_dir, "--cp", "2", "--nprocs", "2", "--cp-balance",
                 "ptrr", "--metrics-out", str(m)], "--cp-balance", m)
    cli_exits_2(["train", "--data", data_dir, "--cp", "2", "--nprocs", "2", "--cp-mode",
                 "ulysses", "--doc-mask", "--cp-balance", "ptrr", "--metrics-out", str(m)],
                "--cp-balance", m)
