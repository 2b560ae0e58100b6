"""Sharded splits (issue 41 item 6): ``fived data prepare --shard-mb`` writes each split as
shards of bounded size, and the loader reads across them — each epoch a permutation of every
window, held one shard at a time (a shard order, then each shard's windows in its own order).

Mutation seen to fail: a shard's window ids without the shard's base (windows of different
shards then share ids: ``test_an_epoch_visits_every_window_once``)."""

import numpy as np
import pytest
import torch
from doc_helpers import missing_file_exits_2, write_documents
from parity_helpers import check_parity, cli_exits_2, one_rank, train_runs

from fived.config import ParallelConfig, preset
from fived.data.loader import Loader
from fived.data.meta import model_for_data
from fived.data.prepare import Options, prepare
from fived.data.shards import DataDir
from fived.testing import small_train


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    src = write_documents(d / "in", n=400)
    prepare(Options((str(src),), str(d / "sh"), val_fraction=0.2, workers=1,
                    shard_mb=2000 / 2**20), lambda s: None)  # shards of at most 2000 bytes
    prepare(Options((str(src),), str(d / "one"), val_fraction=0.2, workers=1), lambda s: None)
    return str(d / "sh"), str(d / "one")


def test_shards_hold_the_same_tokens_as_one_file(sharded):
    sh, one = DataDir(sharded[0]), DataDir(sharded[1])
    parts = sh.shards("train")
    assert len(parts) > 4 and all(p["tokens"] * 2 <= 2000 or p["documents"] == 1 for p in parts)
    joined = np.concatenate([np.asarray(sh.shard_tokens("train", j)) for j in range(len(parts))])
    assert np.array_equal(joined, np.asarray(one.tokens("train")))
    assert sh.meta["data_hash"] == one.meta["data_hash"]
    offs = [sh.shard_documents("train", j) for j in range(len(parts))]
    assert sum(len(o) - 1 for o in offs) == one.meta["splits"]["train"]["documents"]


def test_an_epoch_visits_every_window_once(sharded):
    ld = Loader(sharded[0], "train", 64, 4, 7, documents=True)
    n = ld.windows
    assert n == sum(int(c) for c in ld.counts) and n > 20
    ids = [i for s in range(n // 4) for i in ld.sequence_ids(s).tolist()]
    assert len(set(ids)) == len(ids)  # no window twice within the epoch
    nxt = Loader(sharded[0], "train", 64, n, 7).sequence_ids(1)  # epoch 1, all of it
    assert sorted(nxt.tolist()) == list(range(n))
    first = Loader(sharded[0], "train", 64, n, 7).sequence_ids(0)
    assert not np.array_equal(first, nxt)
    # a row is its shard's window, and its ids follow that shard's offsets
    x, _, docs = ld.global_batch(2)
    for r, g in enumerate(ld.sequence_ids(2).tolist()):
        j = int(np.searchsorted(ld.base, g, side="right")) - 1
        k = g - int(ld.base[j])
        toks = np.asarray(ld.data.shard_tokens("train", j))[k * 64:k * 64 + 64]
        assert torch.equal(x[r], torch.from_numpy(toks.astype(np.int64)))
        offs = ld.data.shard_documents("train", j)
        assert all(offs[int(d)] <= k * 64 + t < offs[int(d) + 1] for t, d in enumerate(docs[r]))


def test_sharded_data_trains_the_same_on_dp2_as_on_one_rank(sharded):
    """Time: a one-rank and a dp2 run (26 s under load, 9 s quiet)."""
    model = model_for_data(preset("tiny"), sharded[0])
    train = small_train(steps=2, data=sharded[0], doc_mask=True)
    check_parity(train_runs([(model, ParallelConfig(dp=2), train)], timeout=600)[0],
                 one_rank(model, train), "dp2 sharded")


def test_a_missing_shard_exits_2(sharded, tmp_path):
    missing_file_exits_2(sharded[0], "train-00002.bin", tmp_path)


def test_a_negative_shard_size_exits_2(tmp_path):
    src = write_documents(tmp_path / "in", n=20)
    cli_exits_2(["data", "prepare", str(src), "--out", str(tmp_path / "o"), "--shard-mb", "-1"],
                "--shard-mb", tmp_path / "o")
