"""``fived data prepare``: the format, the split, the tokenizers, the no-op re-run, bad input."""

import json
import os
import sys

import numpy as np
import pytest

from fived.config import ConfigError
from fived.data.meta import padded_vocab, read_meta
from fived.data.prepare import Options, is_val, prepare, training_documents
from fived.data.shards import DataDir

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import run_cli  # noqa: E402,I001

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
QUIET = lambda s: None  # noqa: E731


def fived(*args, timeout=300):
    """``fived ARGS`` in this process: the subject is the command, not the interpreter."""
    return run_cli(*args)


def texts(n=10):
    return [f"document {i}: " + " ".join(f"w{(i * 7 + k) % 31}" for k in range(40 + i))
            for i in range(n)]


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "txt"
    (d / "sub").mkdir(parents=True)
    docs = texts()
    for i, t in enumerate(docs):
        (d / ("sub" if i % 2 else "") / f"f{i:02d}.txt").write_text(t)
    (d / ".hidden.txt").write_text("never read")
    (d / "empty.txt").write_text("")
    return d


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_byte_format_split_and_index(corpus, tmp_path):
    out = tmp_path / "out"
    meta = prepare(Options((str(corpus),), str(out), val_fraction=0.2, workers=1), QUIET)
    files = sorted(p for p in corpus.rglob("*.txt") if not p.name.startswith(".")
                   and p.stat().st_size)
    docs = [p.read_text() for p in files]  # the walk order: sorted paths
    assert meta["documents"] == len(docs) == 10
    assert meta["splits"]["val"]["documents"] == 2  # floor(10 · 0.2), evenly spread
    assert meta["vocab"] == 257 and meta["eos"] == 256 and meta["dtype"] == "uint16"
    d = DataDir(out)
    for split in ("train", "val"):
        want = [t for i, t in enumerate(docs) if is_val(i, 0.2) == (split == "val")]
        tok, idx = d.tokens(split), d.documents(split)
        assert len(idx) == len(want) + 1 and idx[-1] == len(tok)
        for k, t in enumerate(want):
            ids = np.asarray(tok[idx[k]:idx[k + 1]])
            assert ids[-1] == 256  # each document ends with EOS
            assert bytes(ids[:-1].astype(np.uint8)).decode() == t
    assert leftovers(tmp_path) == []


def test_few_documents_hold_out_the_last(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"text {i}")
    meta = prepare(Options((str(tmp_path),), str(tmp_path.parent / (tmp_path.name + "-out")),
                           val_fraction=0.01, workers=1), QUIET)
    assert meta["splits"]["val"]["documents"] == 1 and meta["splits"]["train"]["documents"] == 2
    assert list(training_documents(iter(["a", "b", "c"]), 0.01)) == ["a", "b"]
    assert list(training_documents(iter(["a", "b", "c"]), 0.0)) == ["a", "b", "c"]
    assert list(training_documents(iter(f"{i}" for i in range(10)), 0.2)) == \
        [f"{i}" for i in range(10) if i not in (4, 9)]
    d = DataDir(tmp_path.parent / (tmp_path.name + "-out"))
    assert bytes(np.asarray(d.tokens("val"))[:-1].astype(np.uint8)) == b"text 2"


def test_rerun_is_a_noop_and_a_change_redoes_it(corpus, tmp_path):
    out = tmp_path / "out"
    opts = Options((str(corpus),), str(out), val_fraction=0.2, workers=1)
    first = prepare(opts, QUIET)
    stamp = (out / "train.bin").stat().st_mtime_ns
    again = prepare(opts, QUIET)
    assert again["skipped"] and (out / "train.bin").stat().st_mtime_ns == stamp
    (corpus / "f00.txt").write_text("changed text")
    third = prepare(opts, QUIET)
    assert not third.get("skipped") and third["data_hash"] != first["data_hash"]
    assert leftovers(tmp_path) == []


def test_bpe_trained_then_reused_and_workers_agree(corpus, tmp_path):
    a = prepare(Options((str(corpus),), str(tmp_path / "a"), train_bpe=300, val_fraction=0.2,
                        workers=1), QUIET)
    # at most 300 (BPE stops when no pair is left to merge in so small a text)
    assert a["tokenizer"]["kind"] == "tokenizers" and 257 < a["vocab"] <= 300
    assert padded_vocab(a["vocab"]) == 384
    # the trained tokenizer.json, given back, tokenizes to the same ids (on 2 processes)
    b = prepare(Options((str(corpus),), str(tmp_path / "b"), val_fraction=0.2, workers=2,
                        tokenizer=str(tmp_path / "a" / "tokenizer.json")), QUIET)
    assert b["tokenizer"]["hash"] == a["tokenizer"]["hash"]
    assert b["data_hash"] == a["data_hash"]
    tok = DataDir(tmp_path / "a").tokenizer()
    t = DataDir(tmp_path / "a")
    idx = t.documents("train")
    first = tok.decode(np.asarray(t.tokens("train")[idx[0]:idx[1]]).tolist())
    assert first == texts()[0]


def test_jsonl_field_and_parquet_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = texts(6)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t, "n": i}) + "\n"
                                              for i, t in enumerate(docs[:3])) + "\n")
    pq.write_table(pa.table({"content": docs[3:], "id": [3, 4, 5]}), tmp_path / "b.parquet")
    meta = prepare(Options((str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")),
                           str(tmp_path / "out"), field="body", column="content",
                           val_fraction=0.0, workers=1), QUIET)
    assert meta["documents"] == 6 and meta["splits"]["val"]["documents"] == 0
    assert meta["tokens"] == sum(len(t.encode()) + 1 for t in docs)


@pytest.mark.parametrize("case", ["empty", "field", "column", "not-data-dir", "bpe-size",
                                  "val-none"])
def test_bad_input_is_one_clean_error_and_writes_nothing(case, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "in"
    src.mkdir()
    out = tmp_path / "out"
    args = [str(src), "--out", str(out), "--workers", "1"]
    if case == "empty":
        (src / "a.txt").write_text("")
        (src / "b.txt").write_text("")
        want = "no text"
    elif case == "field":
        (src / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"t": 1}))
        want = "has no field 'text'"
    elif case == "column":
        pq.write_table(pa.table({"body": ["some text"]}), src / "a.parquet")
        want = "has no column 'text'"
    elif case == "not-data-dir":
        (src / "a.txt").write_text("hello")
        out.mkdir()
        (out / "precious.txt").write_text("keep me")
        want = "not a fived data directory"
    elif case == "bpe-size":
        (src / "a.txt").write_text("hello")
        args += ["--train-bpe", "100"]
        want = "--train-bpe 100"
    else:
        (src / "a.txt").write_text("hello")
        args += ["--val-fraction", "0.1"]
        want = "holds out none"
    r = fived("data", "prepare", *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("ConfigError") == 1 and want in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    if case == "not-data-dir":
        assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    else:
        assert not out.exists()
    assert leftovers(tmp_path) == []


def test_train_rejects_bad_data_before_any_rank(corpus, tmp_path):
    out = tmp_path / "d"
    n = prepare(Options((str(corpus),), str(out), train_bpe=300, val_fraction=0.2, workers=1),
                QUIET)["vocab"]
    r = fived("train", "--data", str(tmp_path / "nope"), "--nprocs", "1")
    assert r.returncode == 2 and "no such directory" in r.stderr, r.stderr
    r = fived("train", "--eval-every", "5", "--nprocs", "1")
    assert r.returncode == 2 and "--eval-every needs --data" in r.stderr, r.stderr
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nvocab = 256\n")  # smaller than the tokenizer's n > 257 symbols
    r = fived("train", "--config", str(toml), "--data", str(out), "--nprocs", "1")
    assert r.returncode == 2 and f"the tokenizer has {n} symbols" in r.stderr, r.stderr
    r = fived("train", "--data", str(out), "--nprocs", "1", "--print-config")
    assert r.returncode == 0 and "vocab = 384" in r.stdout, r.stdout + r.stderr
    (tmp_path / "f").write_text("")  # TensorBoard makes its directories, but not under a file
    r = fived("train", "--tensorboard", str(tmp_path / "f" / "tb"), "--nprocs", "1")
    assert r.returncode == 2 and "is a file, not a directory" in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="not a prepared data directory"):
        read_meta(corpus)


def test_data_info_and_prepare_cli(corpus, tmp_path):
    out = tmp_path / "d"
    r = fived("data", "prepare", str(corpus), "--out", str(out), "--val-fraction", "0.2",
              "--workers", "1")
    assert r.returncode == 0 and "train" in r.stdout and "vocab 384" in r.stdout, r.stderr
    r = fived("data", "info", str(out), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["documents"] == 10
    r = fived("data", "prepare", str(corpus), "--out", str(out), "--val-fraction", "0.2")
    assert r.returncode == 0 and "up to date" in r.stdout


def test_large_vocabulary_is_uint32_and_eos_is_appended(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    words["[UNK]"] = 70_000
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("w1 w69999 w5")
    (tmp_path / "in" / "b.txt").write_text("w7 zzz")
    meta = prepare(Options((str(tmp_path / "in"),), str(tmp_path / "out"),
                           tokenizer=str(tmp_path / "tokenizer.json"), val_fraction=0.0,
                           workers=1), QUIET)
    assert meta["dtype"] == "uint32" and meta["vocab"] == 70_002 and meta["eos"] == 70_001
    assert np.asarray(DataDir(tmp_path / "out").tokens("train")).tolist() == \
        [1, 69_999, 5, 70_001, 7, 70_000, 70_001]
