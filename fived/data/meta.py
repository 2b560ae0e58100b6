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
from dataclasses import replace
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


def model_for_data(model: ModelConfig, data: str, vocab_given: bool = False) -> ModelConfig:
    """The model with the vocabulary of ``data``'s tokenizer (padded), or, when the run set
    ``vocab`` itself (TOML [model] vocab), that vocabulary checked to hold the tokenizer's."""
    if not data:
        return model
    meta = read_meta(data)
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
        if getattr(train, "doc_mask", False):
            raise ConfigError(["--doc-mask needs --data DIR (the built-in corpus is one stream "
                               "of files with no document boundaries)"])
        if train.eval_every:
            raise ConfigError(["--eval-every needs --data DIR (the built-in corpus has no "
                               "validation split)"])
        return None
    meta = read_meta(train.data)
    n = int(meta["vocab"])
    problems = []
    if getattr(train, "cp_balance", "zigzag") != "zigzag" and not train.doc_mask:
        problems.append(f"--cp-balance {train.cp_balance} needs --doc-mask (without documents "
                        "zigzag is balanced)")
    if model.vocab < n:
        problems.append(f"--data {train.data}: the tokenizer has {n} symbols but the model's "
                        f"vocab is {model.vocab}; use a model vocab >= {n}")
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
