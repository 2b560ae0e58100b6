"""``fived data prepare``: text, JSONL or parquet -> token shards, a document index, metadata.

The output directory (format ``fived-tokens/1``, see docs/data.md)::

    meta.json        vocab, eos, dtype, tokenizer hash, per split tokens and documents,
                     source_hash (what was read, with which options), data_hash (the tokens)
    tokenizer.json   the tokenizer (absent for ``byte``)
    train.bin        the training documents' token ids, each document followed by EOS,
                     uint16 when vocab <= 65536 else uint32 (np.memmap reads it)
    train.idx.npy    int64 offsets: document d is train.bin[idx[d]:idx[d+1]] (its EOS last)
    val.bin, val.idx.npy   the held-out documents, the same way

Documents: a text file is one document; a JSONL line is one (``--field``); a parquet row is one
(``--column``); empty ones are skipped. Non-empty document ``i`` (in input order: the inputs as
given, folders walked in sorted order) is held out for validation when
``floor((i + 1)·f) > floor(i·f)`` for ``f = --val-fraction``: exactly ``floor(n·f)`` documents,
evenly spread; when that is none (fewer than ``1/f`` documents) the last document is held
out. A BPE tokenizer (``--train-bpe``) is trained on the training documents only.

Tokenizing runs on ``--workers`` processes (all cores by default) over chunks of documents, in
order. Everything is written into a temporary directory beside ``--out`` and renamed onto it at
the end: a failure or an interrupt leaves no half-written directory. Re-running with the same
inputs (paths, sizes, modification times) and options finds ``source_hash`` unchanged and
does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError
from . import tokenizer as tokenize
from .meta import FORMAT, read_meta

CHUNK_CHARS = 1 << 20  # characters of text per worker task
CHUNK_DOCS = 512


@dataclass(frozen=True)
class Options:
    inputs: tuple[str, ...]
    out: str
    tokenizer: str = "byte"
    train_bpe: int = 0
    field: str = "text"
    column: str = "text"
    glob: str = "*"
    exclude: tuple[str, ...] = ()  # folder or file name patterns skipped in folders
    val_fraction: float = 0.01
    workers: int = 0  # 0: every core
    shard_mb: float = 0.0  # > 0: each split as shards of at most this many MB (a document whole)


# ---------------------------------------------------------------------------- inputs
def kind_of(path: Path) -> str:
    s = path.suffix.lower()
    return "jsonl" if s in (".jsonl", ".json", ".ndjson") else "parquet" if s == ".parquet" \
        else "text"


def find_sources(inputs: tuple[str, ...], glob: str, exclude: tuple[str, ...] = ()
                 ) -> list[tuple[Path, str]]:
    """Every input file with its kind; folders walked (sorted; hidden entries and entries
    whose name matches an ``exclude`` pattern skipped, with everything under them)."""
    if not inputs:
        raise ConfigError(["fived data prepare: give at least one INPUT (a file or a folder)"])
    out: list[tuple[Path, str]] = []
    for name in inputs:
        p = Path(name)
        if p.is_dir():
            files = sorted(f for f in p.rglob(glob) if f.is_file()
                           and not any(x.startswith(".") or any(fnmatch(x, e) for e in exclude)
                                       for x in f.relative_to(p).parts))
            if not files:
                raise ConfigError([f"INPUT {name}: no file under it matches --glob {glob!r}"])
            out += [(f, kind_of(f)) for f in files]
        elif p.is_file():
            out.append((p, kind_of(p)))
        else:
            raise ConfigError([f"INPUT {name}: no such file or folder"])
    return out


def documents(sources: list[tuple[Path, str]], field: str, column: str) -> Iterator[str]:
    """The non-empty documents of every source, in order; a ConfigError names a bad one."""
    for path, kind in sources:
        if kind == "text":
            text = path.read_text("utf-8", errors="replace")
            if text:
                yield text
        elif kind == "jsonl":
            yield from _jsonl(path, field)
        else:
            yield from _parquet(path, column)


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise ConfigError([f"{path}:{n}: not a JSON line"]) from None
            if not isinstance(obj, dict) or field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise ConfigError([f"--field {field}: {path}:{n} has no field {field!r} "
                                   f"(it has {keys}); pass --field NAME"])
            v = obj[field]
            if not isinstance(v, str):
                raise ConfigError([f"--field {field}: {path}:{n}: the value is a "
                                   f"{type(v).__name__}, not text"])
            if v:
                yield v


def _parquet(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise ConfigError([f"{path}: not a readable parquet file ({e})"]) from None
    names = pf.schema_arrow.names
    if column not in names:
        raise ConfigError([f"--column {column}: {path} has no column {column!r} (it has "
                           f"{names}); pass --column NAME"])
    for batch in pf.iter_batches(columns=[column], batch_size=1024):
        for v in batch.column(0).to_pylist():
            if v:
                yield str(v)


def is_val(i: int, fraction: float) -> bool:
    return int((i + 1) * fraction) > int(i * fraction)


def training_documents(docs: Iterator[str], fraction: float) -> Iterator[str]:
    """The documents ``_write`` puts in the training split (the last one held back until it
    is known not to become the validation split)."""
    held, n, n_val = None, 0, 0
    for i, d in enumerate(docs):
        n += 1
        if is_val(i, fraction):
            n_val += 1
            continue
        if held is not None:
            yield held
        held = d
    if held is not None and not (fraction > 0 and n_val == 0 and n > 1):
        yield held


def source_hash(sources: list[tuple[Path, str]], opts: Options, tok_id: str) -> str:
    """What prepare would read and how: equal hashes -> the same output (the no-op test)."""
    files = []
    for p, kind in sources:
        st = p.stat()
        files.append([str(p.resolve()), st.st_size, st.st_mtime_ns, kind])
    doc = {"format": FORMAT, "files": files, "tokenizer": tok_id, "val": opts.val_fraction,
           "field": opts.field, "column": opts.column, "glob": opts.glob,
           "exclude": list(opts.exclude), **({"shard_mb": opts.shard_mb} if opts.shard_mb else {})}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------- workers
_TOK: tokenize.Tokenizer | None = None
_DTYPE: Any = None


def _init(spec: str, dtype: str) -> None:
    global _TOK, _DTYPE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _TOK, _DTYPE = tokenize.from_spec(spec), np.dtype(dtype)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the chunk's ids with EOS after each document, tokens per document)."""
    assert _TOK is not None
    ids = _TOK.encode_batch(texts)
    lens = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lens.sum()), dtype=_DTYPE)
    ends = np.cumsum(lens)
    for x, e, n in zip(ids, ends, lens):
        flat[e - n:e - 1] = x
        flat[e - 1] = _TOK.eos
    return flat, lens


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    buf: list[str] = []
    size = 0
    for d in docs:
        buf.append(d)
        size += len(d)
        if size >= CHUNK_CHARS or len(buf) >= CHUNK_DOCS:
            yield buf
            buf, size = [], 0
    if buf:
        yield buf


class Progress:
    """One status line, rewritten at most every half second (every 5 s when not a terminal)."""

    def __init__(self, what: str, stream: Any = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.what, self.t0 = what, time.perf_counter()
        self.last = self.t0 if not self.tty else 0.0

    def update(self, docs: int, tokens: int, chars: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        line = (f"{self.what}: {docs:,} documents, {tokens:,} tokens, {chars / 2**20:.1f} MiB "
                f"of text ({chars / 2**20 / dt:.1f} MiB/s, {dt:.0f} s)")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------- prepare
def check_out(out: Path) -> bool:
    """True when ``out`` exists as a fived data directory that may be replaced."""
    ancestor = next(p for p in (out.parent.resolve(), *out.parent.resolve().parents)
                    if p.exists())
    if not ancestor.is_dir():
        raise ConfigError([f"--out {out}: {str(ancestor)!r} is a file, not a folder"])
    if not out.exists():  # missing parent folders are made when the inputs are read
        return False
    if out.is_dir() and (out / "meta.json").is_file():
        return True
    if out.is_dir() and not any(out.iterdir()):
        return True
    raise ConfigError([f"--out {out}: exists and is not a fived data directory; choose another "
                       f"path (prepare never overwrites other files)"])


def prepare(opts: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare ``opts.out``; returns its meta (with ``"skipped": True`` when it was current)."""
    t0 = time.perf_counter()
    if not opts.shard_mb >= 0:
        raise ConfigError([f"--shard-mb must be >= 0 (got {opts.shard_mb:g}; 0: one file)"])
    if not 0.0 <= opts.val_fraction < 1.0:
        raise ConfigError([f"--val-fraction must be in [0, 1) (got {opts.val_fraction:g})"])
    if opts.train_bpe and opts.tokenizer != "byte":
        raise ConfigError(["--train-bpe and --tokenizer FILE exclude each other; give one"])
    out = Path(opts.out)
    sources = find_sources(opts.inputs, opts.glob, opts.exclude)  # a missing INPUT first
    exists = check_out(out)
    tok: tokenize.Tokenizer | None = None
    if opts.train_bpe:
        if not tokenize.MIN_BPE <= opts.train_bpe <= tokenize.MAX_BPE:
            tokenize.train_bpe([], opts.train_bpe)  # raises the ConfigError
        tok_id = f"bpe:{opts.train_bpe}"
    else:
        tok = tokenize.load(opts.tokenizer)
        tok_id = tok.hash
    src = source_hash(sources, opts, tok_id)
    if exists and (out / "meta.json").is_file():
        old = read_meta(out, "--out")
        if old.get("source_hash") == src:
            log(f"{out}: up to date (same inputs and options); nothing to do")
            return {**old, "skipped": True}
    fields = {k for _, k in sources}
    log(f"fived data prepare: {len(sources)} file(s) "
        f"({', '.join(sorted(fields))}) -> {out}")
    if tok is None:
        log(f"training a byte-level BPE of {opts.train_bpe} symbols on the training documents")
        docs = documents(sources, opts.field, opts.column)
        tok = tokenize.train_bpe(training_documents(docs, opts.val_fraction), opts.train_bpe)
        log(f"BPE trained in {time.perf_counter() - t0:.1f} s (tokenizer {tok.hash[:12]})")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _write(tmp, tok, sources, opts)
        meta.update(source_hash=src, seconds=round(time.perf_counter() - t0, 3),
                    options=asdict(opts), inputs={"files": len(sources),
                                                  "bytes": sum(p.stat().st_size
                                                               for p, _ in sources)})
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        if exists:
            trash = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, trash)
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


class Shards:
    """The token files of the two splits as they are written. ``limit`` 0: one file per split
    (``train.bin``, ``train.idx.npy``: the format before shards); > 0: shards
    ``train-00000.bin`` ... of at most ``limit`` bytes (a document is never cut; one longer
    than ``limit`` fills a shard alone), each with its own ``.idx.npy`` (offsets from 0). Only
    the open shard's offsets are held in memory."""

    def __init__(self, tmp: Path, limit: int):
        self.tmp, self.limit = tmp, limit
        self.done: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
        self.file: dict[str, Any] = {}
        self.offsets: dict[str, list[int]] = {}
        self.bytes: dict[str, int] = {}
        self.total = {"train": 0, "val": 0}
        self.docs = {"train": 0, "val": 0}
        for s in ("train", "val"):
            self._open(s)

    def _name(self, s: str) -> str:
        return s if not self.limit else f"{s}-{len(self.done[s]):05d}"

    def _open(self, s: str) -> None:
        self.file[s] = open(self.tmp / f"{self._name(s)}.bin", "wb")
        self.offsets[s], self.bytes[s] = [0], 0

    def _close(self, s: str) -> None:
        name = self._name(s)
        self.file[s].close()
        np.save(self.tmp / f"{name}.idx.npy", np.asarray(self.offsets[s], dtype=np.int64))
        self.done[s].append({"file": f"{name}.bin", "index": f"{name}.idx.npy",
                             "tokens": self.offsets[s][-1],
                             "documents": len(self.offsets[s]) - 1})

    def put(self, s: str, piece: bytes, n: int) -> None:
        if self.limit and self.bytes[s] and self.bytes[s] + len(piece) > self.limit:
            self._close(s)
            self._open(s)
        self.file[s].write(piece)
        self.bytes[s] += len(piece)
        self.offsets[s].append(self.offsets[s][-1] + n)
        self.total[s] += n
        self.docs[s] += 1

    def documents(self, s: str) -> int:
        return self.docs[s]

    def close(self) -> None:
        for s in ("train", "val"):
            if not self.file[s].closed:
                self._close(s)

    def meta(self, s: str) -> dict[str, Any]:
        if not self.limit:  # the one-file format, unchanged
            return {"tokens": self.total[s], "documents": self.docs[s], "file": f"{s}.bin",
                    "index": f"{s}.idx.npy"}
        return {"tokens": self.total[s], "documents": self.docs[s], "shards": self.done[s]}


def _write(tmp: Path, tok: tokenize.Tokenizer, sources: list[tuple[Path, str]], opts: Options
           ) -> dict[str, Any]:
    dtype = "uint16" if tok.vocab <= 1 << 16 else "uint32"
    limit = int(opts.shard_mb * 2**20)  # bytes per shard; 0: one file per split
    splits_out = Shards(tmp, limit)
    hashes = {s: hashlib.sha256() for s in ("train", "val")}
    counts = {"docs": 0, "tokens": 0, "chars": 0}
    progress = Progress("tokenizing")
    chars: deque[int] = deque()

    held: list[tuple[bytes, int]] = []  # the latest training document, written at the next

    def put(s: str, piece: bytes, n: int) -> None:
        splits_out.put(s, piece, n)
        hashes[s].update(piece)

    def write(flat: np.ndarray, lens: np.ndarray) -> None:
        ends = np.cumsum(lens)
        for e, n in zip(ends.tolist(), lens.tolist()):
            piece = flat[e - n:e].tobytes()
            if is_val(counts["docs"], opts.val_fraction):
                put("val", piece, n)
            else:
                if held:
                    put("train", *held.pop())
                held.append((piece, n))
            counts["docs"] += 1
            counts["tokens"] += n
        counts["chars"] += chars.popleft()
        progress.update(counts["docs"], counts["tokens"], counts["chars"])

    workers = opts.workers or os.cpu_count() or 1
    chunks = _chunks(documents(sources, opts.field, opts.column))
    try:
        if workers == 1:
            _init(tok.spec, dtype)
            for c in chunks:
                chars.append(sum(map(len, c)))
                write(*_encode(c))
        else:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(workers, _init, (tok.spec, dtype)) as pool:
                pending: deque = deque()
                for c in chunks:
                    chars.append(sum(map(len, c)))
                    pending.append(pool.apply_async(_encode, (c,)))
                    while len(pending) > 2 * workers:
                        write(*pending.popleft().get())
                while pending:
                    write(*pending.popleft().get())
        if held:  # floor(n·f) = 0 held out nothing: the last document is the validation split
            last_to_val = (opts.val_fraction > 0 and splits_out.documents("val") == 0
                           and counts["docs"] > 1)
            put("val" if last_to_val else "train", *held.pop())
    finally:
        splits_out.close()
    progress.update(counts["docs"], counts["tokens"], counts["chars"], force=True)
    progress.done()
    if counts["docs"] == 0:
        raise ConfigError([f"INPUT {' '.join(opts.inputs)}: no text (every document is empty)"])
    n_val = splits_out.documents("val")
    if opts.val_fraction > 0 and n_val == 0:
        raise ConfigError([f"--val-fraction {opts.val_fraction:g} holds out none: the input is "
                           f"one document; add documents or pass --val-fraction 0"])
    splits = {s: splits_out.meta(s) for s in ("train", "val")}
    tok_file = None
    if isinstance(tok, tokenize.HFTokenizer):
        tok.save(tmp / "tokenizer.json")
        tok_file = "tokenizer.json"
    data_hash = hashlib.sha256((hashes["train"].hexdigest() + hashes["val"].hexdigest())
                               .encode()).hexdigest()
    return {"format": FORMAT, "vocab": tok.vocab, "eos": tok.eos, "dtype": dtype,
            "tokenizer": {"kind": tok.kind, "hash": tok.hash, "file": tok_file},
            "splits": splits, "documents": counts["docs"], "tokens": counts["tokens"],
            "chars": counts["chars"], "data_hash": data_hash}
