"""Tokenizers: the built-in byte vocabulary, a Hugging Face ``tokenizer.json``, or a byte-level
BPE trained here with the ``tokenizers`` library.

Every tokenizer has ``vocab`` symbols (EOS included), an ``eos`` id appended after each
document, a ``spec`` (the text that rebuilds it in a worker process: ``"byte"`` or the
tokenizer's JSON) and a ``hash`` (sha256 of the spec) that a data directory and a checkpoint
record, so a run cannot mix token ids of two tokenizers.

* ``byte``: ids 0..255 are the UTF-8 bytes of the text, 256 is EOS (257 symbols).
* ``tokenizer.json``: ``tokenizers.Tokenizer.from_file``; EOS is the first of
  ``EOS_NAMES`` the vocabulary holds, else one id appended after the vocabulary.
* ``--train-bpe V``: byte-level BPE (GPT-2's pre-tokenizer and byte alphabet) with ``V``
  symbols, ``<|endoftext|>`` among them, trained on the training documents only.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..config import ConfigError

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
BYTE_SPEC = "byte"
MIN_BPE = 257  # the 256-symbol byte alphabet + EOS
MAX_BPE = 1 << 20


class Tokenizer:
    """``encode_batch(texts) -> [[id, ...], ...]`` without EOS; ``vocab``, ``eos``, ``spec``."""

    kind = "?"
    vocab: int
    eos: int
    spec: str

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.spec.encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    kind = "byte"
    vocab, eos, spec = 257, 256, BYTE_SPEC

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    kind = "tokenizers"

    def __init__(self, tok) -> None:
        self.tok = tok
        self.spec = tok.to_str()
        n = tok.get_vocab_size(with_added_tokens=True)
        ids = [tok.token_to_id(name) for name in EOS_NAMES]
        found = [i for i in ids if i is not None]
        self.eos = found[0] if found else n
        self.vocab = n if found else n + 1

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i != self.eos])

    def save(self, path: Path) -> None:
        path.write_text(self.spec)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ``tokenizers``' ByteLevel uses)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def hf_json(tok: Tokenizer) -> str:
    """``tok`` as a ``tokenizer.json`` that ``tokenizers`` (and transformers' AutoTokenizer)
    load with the same ids: the byte vocabulary as a byte-level BPE without merges, where id
    ``b`` is byte ``b`` and 256 is ``<|endoftext|>``; a tokenizer.json one as it is."""
    if not isinstance(tok, ByteTokenizer):
        return tok.spec
    from tokenizers import Tokenizer as T
    from tokenizers import decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    hf = T(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOS_NAMES[0]])  # id 256, the byte vocabulary's EOS
    return hf.to_str()


def hf_files(tok: Tokenizer, max_length: int) -> dict[str, str]:
    """What transformers' ``AutoTokenizer.from_pretrained(DIR)`` reads, by file name:
    ``tokenizer.json``, ``tokenizer_config.json`` (a fast tokenizer, its EOS, the model's
    length) and ``special_tokens_map.json``."""
    import json

    spec = hf_json(tok)
    from tokenizers import Tokenizer as T

    eos = T.from_str(spec).id_to_token(tok.eos)  # None: an EOS appended after the vocabulary
    special = {"eos_token": eos} if eos else {}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, **special}
    return {"tokenizer.json": spec, "tokenizer_config.json": json.dumps(config, indent=1),
            "special_tokens_map.json": json.dumps(special, indent=1)}


def from_spec(spec: str) -> Tokenizer:
    """Rebuild a tokenizer from its ``spec`` (in a worker process, or from a data directory)."""
    if spec == BYTE_SPEC:
        return ByteTokenizer()
    from tokenizers import Tokenizer as T

    return HFTokenizer(T.from_str(spec))


def load(name: str) -> Tokenizer:
    """``byte`` or a path to a ``tokenizer.json``; a ConfigError naming --tokenizer otherwise."""
    if name == BYTE_SPEC:
        return ByteTokenizer()
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError([f"--tokenizer {name}: not 'byte' and no such tokenizer.json"])
    from tokenizers import Tokenizer as T

    try:
        return HFTokenizer(T.from_file(str(path)))
    except Exception as e:  # the tokenizers library raises plain Exceptions on bad JSON
        raise ConfigError([f"--tokenizer {name}: cannot load it with `tokenizers` ({e})"]) from None


def train_bpe(texts: Iterable[str], vocab: int, length: int | None = None) -> HFTokenizer:
    """A byte-level BPE of ``vocab`` symbols (``<|endoftext|>`` included) trained on ``texts``."""
    if not MIN_BPE <= vocab <= MAX_BPE:
        raise ConfigError([f"--train-bpe {vocab}: give a vocabulary in [{MIN_BPE}, {MAX_BPE}] "
                           f"(256 bytes + EOS at least)"])
    from tokenizers import Tokenizer as T
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = T(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS_NAMES[0]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    tok.train_from_iterator(_nonempty(texts), trainer=trainer, length=length)
    return HFTokenizer(tok)


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    return (t for t in texts if t)
