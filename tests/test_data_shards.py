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


def traced_peak(fn) -> int:
    """Peak bytes Python and numpy allocated while ``fn()`` ran (``tracemalloc``)."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_prepare_and_an_epoch_of_the_loader_stay_flat_as_the_corpus_grows(tmp_path,
                                                                          monkeypatch):
    """Corpora of 512 KiB, 1 and 2 MiB of text in shards of 16 KiB (about 30, 60 and 120
    shards: the largest 60× the two the loader holds). ``prepare`` (text read in 32 KiB chunks
    here, 1 MiB in real runs) and one epoch of the loader reading every window with its
    document ids: the peak of what they allocate (``tracemalloc``) grows by at most 1 KiB per
    added shard (the shard list of ``meta.json``: 1/16 of a shard's bytes) and stays within
    1.25× of the smallest corpus's, and the loader keeps at most two shards open (maps,
    offsets, window orders). ``test_rss_stays_flat_on_a_corpus_of_many_shards`` (slow)
    measures the processes' resident memory.

    Mutation seen to fail: ``DataDir.shard_tokens`` keeping every shard's map open.
    Time: 3 s at load ~10, 12 s at load ~20."""
    from doc_helpers import text_corpus

    import fived.data.prepare as prep

    monkeypatch.setattr(prep, "CHUNK_CHARS", 1 << 15)
    shards, prepares, loaders = [], [], []
    for kib in (512, 1024, 2048):
        src = text_corpus(tmp_path / f"c{kib}.jsonl", kib)
        out = tmp_path / f"d{kib}"
        opts = Options((str(src),), str(out), val_fraction=0.01, workers=1,
                       shard_mb=16 / 1024)
        prepares.append(traced_peak(lambda opts=opts: prepare(opts, lambda s: None)))
        ld = Loader(str(out), "train", 256, 32, seed=1, documents=True)
        shards.append(len(ld.counts))
        ld.batch(0)  # warm-up: numpy's and the loader's first allocations

        def epoch(ld=ld):
            for s in range(1, ld.windows // 32):
                ld.batch(s)
                assert len(ld.data._maps) <= 2 and len(ld._shard_offsets) <= 2
                assert len(ld._shard_perms) <= 2 and len(ld._orders) <= 2

        loaders.append(traced_peak(epoch))
    assert shards[-1] >= 40, shards
    added = shards[-1] - shards[0]
    for peaks in (prepares, loaders):
        assert max(peaks) - min(peaks) <= 1024 * added, (peaks, shards)
        assert max(peaks) <= 1.25 * min(peaks), (peaks, shards)


RSS_EPOCH = """
import sys
from fived.data.loader import Loader


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


ld = Loader(sys.argv[1], "train", 512, 64, seed=1, documents=True)
ld.batch(0)
before = status("VmRSS")
for s in range(1, ld.windows // 64):
    ld.batch(s)
print(len(ld.counts), status("VmHWM") - before)
"""


def peak_of(cmd: list[str]) -> tuple[int, str]:
    """(peak RSS of the command's process, its stdout): ``getrusage`` of a wrapper's child."""
    import subprocess
    import sys

    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], "
            "capture_output=True, text=True); sys.stderr.write(r.stderr); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(r.stdout, "
            "end=''); sys.exit(r.returncode)")
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    first, _, rest = out.stdout.partition("\n")
    return int(first) * 1024, rest


@pytest.mark.slow
def test_rss_stays_flat_on_a_corpus_of_many_shards(tmp_path):
    """Corpora of 4, 8 and 16 MiB of text in shards of 128 KiB of tokens (66 to 264 shards:
    the largest 132× the two shards the loader holds): the peak RSS of ``fived data prepare``
    (one worker) and of ``fived train --doc-mask`` (5 steps) is the same at every size within
    15 %, and a process reading one whole epoch of the loader with document ids grows by
    less than 4 MiB over its RSS before the epoch, at every size.

    Mutation seen to fail: ``DataDir.shard_tokens`` keeping every shard's map open (the
    epoch's growth is then the corpus's tokens: every page read stays mapped).
    Time: ~2.5 min at load 20."""
    import json
    import sys

    from doc_helpers import text_corpus

    fived = [sys.executable, "-m", "fived"]
    prepares, epochs, trains, shards = [], [], [], []
    for mib in (4, 8, 16):
        src = text_corpus(tmp_path / f"c{mib}.jsonl", mib * 1024)
        out = tmp_path / f"d{mib}"
        rss, _ = peak_of([*fived, "data", "prepare", str(src), "--out", str(out),
                          "--shard-mb", "0.125", "--workers", "1", "--val-fraction", "0.01"])
        prepares.append(rss)
        _, text = peak_of([sys.executable, "-c", RSS_EPOCH, str(out)])
        n, grown = text.split()[:2]
        shards.append(int(n))
        epochs.append(int(grown))
        m = tmp_path / f"m{mib}.jsonl"
        peak_of([*fived, "train", "--data", str(out), "--seq-len", "512", "--global-batch",
                 "8", "--steps", "5", "--nprocs", "1", "--doc-mask", "--metrics-out", str(m)])
        recs = [json.loads(x) for x in m.read_text().splitlines() if x.startswith("{")]
        trains.append(max(r.get("rss_peak", 0) for r in recs))
    print("shards", shards, "prepare", prepares, "epoch", epochs, "train", trains)
    assert shards[-1] >= 100, shards
    for what, peaks in (("prepare", prepares), ("train", trains)):
        assert max(peaks) <= 1.15 * min(peaks), (what, peaks, shards)
    assert max(epochs) < 4 * 2**20, (epochs, shards)
