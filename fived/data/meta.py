"""A prepared data directory's metadata, and the model vocabulary it implies (torch-free).

``fived data prepare`` writes ``DIR/meta.json``; the command line reads it before any rank
starts (the vocabulary rule, the bad-input checks), so this module imports neither torch nor
numpy.

The vocabulary rule: a tokenizer of ``n`` symbols (its EOS included) trains a model of
``padded_vocab(n) = ceil(n / 128) · 128`` rows. The padding does not depend on the layout — the
same model on every layout, as every parity test needs — and every tp that is a power of two up to
128 divides it (Megatron pads to a multiple of 128·tp instead, which makes the model change with
tp). The padded rows' logits are masked to the dtype's minimum before the loss
(``fived.data.vocab.mask_padded_logits``), so they never change the loss or its gradient.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import ConfigError, ModelConfig

FORMAT = "fived-tokens/1"
PAD_MULTIPLE = 128


def padded_vocab(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def read_meta(path: str | Path, flag: str = "--data") -> dict[str, Any]:
    """``DIR/meta.json`` of a prepared directory, or a ConfigError saying what is wrong."""
    d = Path(path)
    if not d.is_dir():
        raise ConfigError([f"{flag} {path}: no such directory; make one with "
                           f"`fived data prepare INPUT... --out {path}`"])
    f = d / "meta.json"
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError):
        raise ConfigError([f"{flag} {path}: not a prepared data directory (no readable "
                           f"meta.json); make one with `fived data prepare`"]) from None
    if meta.get("format") != FORMAT:
        raise ConfigError([f"{flag} {path}: format {meta.get('format')!r}, expected {FORMAT!r}; "
                           f"prepare it again"])
    return meta


@dataclass(frozen=True)
class Source:
    """One source of a mixture: ``name=DIR:weight``."""

    name: str
    path: str
    weight: float


def parse_mixture(spec: str, flag: str = "--data") -> list[Source] | None:
    """``--data code=DIR1:0.3,web=DIR2:0.7`` -> the sources (weights as given; they are
    normalised by their sum); None for a plain directory (no ``=``). A ConfigError naming
    ``flag`` when a part does not parse, a weight is not a number >= 0, two sources share a
    name, or the weights sum to zero."""
    if "=" not in spec:
        return None
    out, problems = [], []
    for part in spec.split(","):
        name, eq, rest = part.strip().partition("=")
        path, colon, w = rest.rpartition(":")
        if not eq or not name or not colon or not path:
            problems.append(f"{flag} {spec!r}: {part!r} is not NAME=DIR:WEIGHT (a mixture is "
                            "code=DIR1:0.3,web=DIR2:0.7)")
            continue
        try:
            weight = float(w)
        except ValueError:
            problems.append(f"{flag}: source {name!r}'s weight {w!r} is not a number")
            continue
        if not weight >= 0 or weight == float("inf"):
            problems.append(f"{flag}: source {name!r}'s weight {w} must be a finite number >= 0")
            continue
        out.append(Source(name, path, weight))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        problems.append(f"{flag} {spec!r}: two sources share a name")
    if not problems and not sum(s.weight for s in out) > 0:
        problems.append(f"{flag} {spec!r}: the weights sum to zero; give at least one > 0")
    if problems:
        raise ConfigError(problems)
    return out


def read_data_meta(spec: str, flag: str = "--data") -> dict[str, Any]:
    """``read_meta`` of a directory, or of a mixture: every source read and checked to share
    the first's tokenizer; the first source's meta with each split's token count the smallest
    of the sources' (what each source must hold) and ``mixture`` the sources."""
    sources = parse_mixture(spec, flag)
    if sources is None:
        return read_meta(spec, flag)
    metas = [read_meta(s.path, f"{flag} {s.name}=") for s in sources]
    first = metas[0]["tokenizer"]["hash"]
    bad = [f"{flag}: source {s.name!r} ({s.path}) was prepared with another tokenizer than "
           f"{sources[0].name!r} (hash {m['tokenizer']['hash'][:12]} vs {first[:12]}); a "
           "mixture's sources must share one" for s, m in zip(sources, metas)
           if m["tokenizer"]["hash"] != first]
    if bad:
        raise ConfigError(bad)
    meta = json.loads(json.dumps(metas[0]))
    for split, info in meta["splits"].items():
        info["tokens"] = min(int(m["splits"].get(split, {}).get("tokens", 0)) for m in metas)
    meta["mixture"] = [{"name": s.name, "dir": s.path, "weight": s.weight} for s in sources]
    return meta


def model_for_data(model: ModelConfig, data: str, vocab_given: bool = False) -> ModelConfig:
    """The model with the vocabulary of ``data``'s tokenizer (padded), or, when the run set
    ``vocab`` itself (TOML [model] vocab), that vocabulary checked to hold the tokenizer's."""
    if not data:
        return model
    meta = read_data_meta(data)
    n = int(meta["vocab"])
    if vocab_given or model.vocab > padded_vocab(n):
        if model.vocab < n:
            raise ConfigError([f"--data {data}: the tokenizer has {n} symbols but the model's "
                               f"vocab is {model.vocab}; drop the TOML's [model] vocab (fived "
                               f"then uses {padded_vocab(n)}) or give one >= {n}"])
        return model
    return replace(model, vocab=padded_vocab(n))


def check_data_run(model: ModelConfig, seq_len: int, train: Any) -> dict[str, Any] | None:
    """Everything a ``--data`` run needs of its directory, before a rank starts."""
    if not train.data:
        if getattr(train, "doc_mask", False) and not getattr(train, "doc_len", ""):
            raise ConfigError(["--doc-mask needs --data DIR (the built-in corpus is one stream "
                               "of files with no document boundaries), or in a --dry-run "
                               "--doc-len N|DIR"])
        if getattr(train, "eos_target", "count") != "count":
            raise ConfigError([f"--eos-target {train.eos_target} needs --data DIR (the built-in "
                               "corpus has no EOS tokens)"])
        if train.eval_every:
            raise ConfigError(["--eval-every needs --data DIR (the built-in corpus has no "
                               "validation split)"])
        return None
    meta = read_data_meta(train.data)
    n = int(meta["vocab"])
    problems = []
    if getattr(train, "cp_balance", "zigzag") != "zigzag" and not train.doc_mask:
        problems.append(f"--cp-balance {train.cp_balance} needs --doc-mask (without documents "
                        "zigzag is balanced)")
    if model.vocab < n:
        problems.append(f"--data {train.data}: the tokenizer has {n} symbols but the model's "
                        f"vocab is {model.vocab}; use a model vocab >= {n}")
    dirs = ([m["dir"] for m in meta["mixture"]] if "mixture" in meta else [train.data])
    for d in dirs:  # a file the loader would open on every rank, missing: say so here
        m = read_meta(d)
        for split, info in m["splits"].items():
            for sh in info.get("shards", [info]):
                for key in ("file", "index"):
                    f = Path(d) / sh.get(key, "")
                    if int(sh.get("tokens", 0)) and not f.is_file():
                        problems.append(f"--data {d}: {f} ({split} split) is missing; prepare "
                                        "the directory again")
    if meta["splits"]["train"]["tokens"] < seq_len + 1:
        problems.append(f"--data {train.data}: {meta['splits']['train']['tokens']} training "
                        f"tokens, fewer than one sequence of {seq_len + 1}; add text")
    if train.eval_every and meta["splits"]["val"]["tokens"] < seq_len + 1:
        problems.append(f"--eval-every: {train.data} has {meta['splits']['val']['tokens']} "
                        f"validation tokens, fewer than one sequence of {seq_len + 1}; prepare "
                        f"with a larger --val-fraction")
    if problems:
        raise ConfigError(problems)
    return meta


def check_doc_dry_run(par: Any, train: Any) -> None:
    """``--dry-run --doc-mask``: its documents (``--doc-len N|DIR``) and a layout whose masked
    attention the dry run runs; a ConfigError naming the flag otherwise."""
    if not train.doc_len:
        raise ConfigError(["--dry-run with --doc-mask needs --doc-len N|DIR: fake tensors hold "
                           "no data, so the documents are N tokens each or a prepared "
                           "directory's"])
    try:
        n = float(train.doc_len)
    except ValueError:
        n = None
    if n is not None and not (n >= 1 and n == int(n)):
        raise ConfigError([f"--doc-len {train.doc_len}: give a document length >= 1 (tokens) "
                           "or a prepared data directory"])
    if n is None:
        read_meta(train.doc_len, "--doc-len")
