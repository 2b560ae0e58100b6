"""Document-mask test data and the unpacked reference (``tests/test_doc_mask.py``).

The reference runs the documents of step 0's global batch one by one, each as its own
unpacked sequence (the part of it a window holds, with that window's targets), and sums their
token losses with the trainer's normalisation (1 / (global batch · seq_len)): what a packed,
masked batch must equal, loss and every parameter's gradient.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def write_documents(folder: Path, n: int = 220, seed: int = 3, short: int = 3,
                    long: int = 70) -> Path:
    """A jsonl file of ``n`` documents of mixed lengths (``short``..``long`` bytes, a few of
    one byte), some longer than a window's chunk, some shorter."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    words = ["def", "x", "return", "for", "in", "(", ")", ":", "+", "1", "if", "else", "y"]
    with open(folder / "docs.jsonl", "w") as f:
        for i in range(n):
            size = 1 if i % 17 == 0 else rng.randint(short, long)
            text = ""
            while len(text) < size:
                text += rng.choice(words) + " "
            f.write(json.dumps({"text": text[:size]}) + "\n")
    return folder / "docs.jsonl"


def prepared(tmp: Path, **kw: Any) -> str:
    from fived.data.prepare import Options, prepare

    src = write_documents(tmp / "in", **kw)
    prepare(Options((str(src),), str(tmp / "out"), val_fraction=0.2, workers=1), lambda s: None)
    return str(tmp / "out")


def unpacked_reference(model_cfg, train, reset: bool) -> dict[str, Any]:
    """Step 0 of ``train`` (its --data) as documents run one by one: the loss and every
    parameter's gradient (sum of per-document token losses / (global batch · seq_len)).
    ``train.eos_target == "ignore"``: each document's logits and a cross-entropy over the
    tokens whose input is not EOS, written here (torch's ``cross_entropy`` over the tokenizer's
    rows), not the trainer's loss modules."""
    import torch
    import torch.nn.functional as F

    from fived.data.loader import Loader
    from fived.data.shards import DataDir
    from fived.data.vocab import mask_padded_logits
    from fived.model.documents import segments
    from fived.model.llama import build_model

    data = DataDir(train.data)
    loader = Loader(data, "train", model_cfg.seq_len, train.global_batch, train.seed,
                    documents=True)
    x, y, docs = loader.global_batch(0)
    model = build_model(model_cfg, train.seed)
    mask_padded_logits(model, data.vocab, model_cfg.vocab)
    total = torch.zeros(())
    n_docs = 0
    for r in range(x.shape[0]):
        for a, e in segments(docs[r]):
            pos = torch.arange(e - a) if reset else torch.arange(a, e)
            if train.eos_target == "ignore":
                logits = model(x[r:r + 1, a:e], pos)[0, :, :data.vocab]
                keep = x[r, a:e] != data.eos
                total = total + F.cross_entropy(logits[keep], y[r, a:e][keep], reduction="sum")
            else:
                total = total + model(x[r:r + 1, a:e], pos, y[r:r + 1, a:e])
            n_docs += 1
    tokens = train.global_batch * model_cfg.seq_len
    (total / tokens).backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    return {"loss": float(total.detach()) / tokens, "grads": grads, "documents": n_docs}


def missing_file_exits_2(data: Path, name: str, tmp_path: Path) -> None:
    """``fived train --data`` on a copy of ``data`` without its file ``name``: exit 2, one
    message naming --data and the file, nothing written."""
    import shutil

    from parity_helpers import cli_exits_2

    d = tmp_path / "d"
    shutil.copytree(data, d)
    (d / name).unlink()
    err = cli_exits_2(["train", "--data", str(d), "--steps", "1", "--nprocs", "1",
                       "--metrics-out", str(tmp_path / "m")], "--data", tmp_path / "m")
    assert name in err


def text_corpus(path: Path, kib: float, seed: int = 0, longest: int = 8192) -> Path:
    """A JSONL corpus of ``kib`` KiB of text: documents of lognormal length (median 2,000
    characters, at most ``longest``) from a 64-letter alphabet (``benchmarks/shard_rss.py``'s,
    smaller; the cap keeps one long document from setting a reader's peak)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .",
                             dtype=np.uint8)
    left = int(kib * 1024)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        while left > 0:
            n = int(min(left, longest, max(1, rng.lognormal(np.log(2000), 1.0))))
            f.write(json.dumps({"text": alphabet[rng.integers(0, len(alphabet), n)]
                                .tobytes().decode()}) + "\n")
            left -= n
    return path


def saved_peaks(rank: int, world: int, runs: list) -> list[dict[bool, int]]:
    """Per run (model, layout, train): step 0's forward and backward of this rank without and
    with ``--doc-mask``, the peak bytes autograd held for backward (``dryrun.LiveSaved``, the
    dry run's count: distinct storages, parameters excluded)."""
    from dataclasses import replace

    import torch

    from fived.train.dryrun import LiveSaved
    from fived.train.trainer import Trainer

    out = []
    for model, par, train in runs:
        peaks = {}
        for masked in (False, True):
            torch.manual_seed(train.seed)
            tr = Trainer(model, par, replace(train, doc_mask=masked), rank, world)
            if tr.executor is not None:
                tr.executor.measure = False
            x, y, pos = tr.local_data(0)
            held = list(tr.stage.parameters()) + [b.param_full for b in tr.engine.buckets]
            with LiveSaved(held) as saved:
                tr.forward_backward(x, y, pos, 1.0)
            tr.engine.finish()
            peaks[masked] = saved.peak
            tr.close()
        out.append(peaks)
    return out


def source_rows(x, y, docs, seq_len: int, names: list[str]):
    """A mixture batch's rows by source (the source index rides in the targets' high bits,
    ``fived.data.vocab.SOURCE_SHIFT``): (index, name, the rows, their ``Documents``
    positions, their targets without the index) for each source that drew a row."""
    import torch

    from fived.data.vocab import SOURCE_SHIFT
    from fived.model.documents import Documents

    src = (y >> SOURCE_SHIFT)[:, 0]
    for k, name in enumerate(names):
        rows = (src == k).nonzero().flatten()
        if len(rows):
            pos = Documents(torch.arange(seq_len).expand(len(rows), -1), docs[rows])
            yield k, name, rows, pos, y[rows] - (k << SOURCE_SHIFT)

