"""``fived data``: prepare text for ``fived train --data DIR``, and describe a prepared directory.

``fived data prepare INPUT... --out DIR`` reads text files and folders, JSONL (``--field``) and
parquet (``--column``), tokenizes them on every core with ``byte``, a ``tokenizer.json`` or a
byte-level BPE it trains (``--train-bpe V``), and writes memory-mapped token shards, a document
index and metadata (``fived.data.prepare``; the format is in docs/data.md). ``fived data info
DIR`` prints a prepared directory's table. Bad input: one ConfigError, exit 2, nothing written.
"""

from __future__ import annotations

import argparse

from ..data.meta import padded_vocab, read_meta
from ..ui.args import Parser
from ..ui.report import console, fmt_n, print_json, show, table

EXAMPLES = """examples:
  fived data prepare notes/ --out data/notes                       # byte tokens (257 symbols)
  fived data prepare $(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])') \\
      --glob '*.py' --exclude site-packages,test,tests --train-bpe 4096 --out data/stdlib
  fived data prepare a.jsonl b.jsonl --field text --tokenizer tokenizer.json --out data/ab
  fived data prepare shard.parquet --column content --out data/pq
  fived data info data/stdlib
  fived train --data data/stdlib --model small --eval-every 50    # then train on it
"""


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived data", description="Prepare text for `fived train --data DIR`.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="sub", required=True, metavar="{prepare,info}")
    p = sub.add_parser("prepare", help="text / JSONL / parquet -> token shards",
                       description="Tokenize INPUTs into DIR: train.bin/val.bin (token ids, each "
                       "document followed by EOS), their document indexes, tokenizer.json and "
                       "meta.json. Written into a temporary directory and renamed: a failure "
                       "leaves nothing. Running it again on unchanged inputs does nothing.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="text files, folders (walked recursively, sorted), .jsonl, .parquet")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    p.add_argument("--tokenizer", default="byte", metavar="byte|FILE",
                   help="'byte' (UTF-8 bytes + EOS, 257 symbols) or a Hugging Face "
                        "tokenizer.json (default: byte)")
    p.add_argument("--train-bpe", type=int, default=0, metavar="VOCAB",
                   help="train a byte-level BPE of VOCAB symbols on the training documents")
    p.add_argument("--field", default="text", help="JSONL: the field holding the text "
                                                   "(default: text)")
    p.add_argument("--column", default="text", help="parquet: the column holding the text "
                                                    "(default: text)")
    p.add_argument("--glob", default="*", help="in folders, only files matching this pattern "
                                               "(default: every file), e.g. '*.py'")
    p.add_argument("--exclude", default="", metavar="PATTERN,...",
                   help="in folders, skip files and folders whose name matches one of these "
                        "patterns, e.g. 'site-packages,test,tests'")
    p.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                   help="documents held out for validation, evenly spread (default: 0.01)")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="tokenizing processes (default 0: every core)")
    p.add_argument("--shard-mb", type=float, default=0.0, metavar="MB",
                   help="write each split as shards of at most MB megabytes (default 0: one "
                        "file per split)")
    p.add_argument("--json", action="store_true", help="print meta.json instead of a table")
    i = sub.add_parser("info", help="describe a prepared directory")
    i.add_argument("dir", metavar="DIR")
    i.add_argument("--json", action="store_true", help="print meta.json")
    return ap


def summary(path: str, meta: dict, note: str = "") -> None:
    con = console()
    t = table(f"{path}{note}", [("split", "l"), ("documents", "r"), ("tokens", "r"),
                                ("file", "l")])
    for s in ("train", "val"):
        info = meta["splits"][s]
        where = info.get("file") or f"{len(info['shards'])} shards"  # --shard-mb
        t.add_row(s, fmt_n(info["documents"]), fmt_n(info["tokens"]), where)
    show(con, t)
    tok = meta["tokenizer"]
    con.print(f"tokenizer {tok['kind']} {tok['hash'][:12]}: {meta['vocab']} symbols (EOS "
              f"{meta['eos']}), stored as {meta['dtype']}; a model trained on it has vocab "
              f"{padded_vocab(meta['vocab'])}")
    if "seconds" in meta and not note:
        mb = meta.get("inputs", {}).get("bytes", 0) / 2**20
        con.print(f"{meta['inputs']['files']} file(s), {mb:.1f} MiB in {meta['seconds']:.1f} s: "
                  f"{meta['tokens'] / max(meta['seconds'], 1e-9):,.0f} tokens/s")


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.sub == "info":
        meta = read_meta(args.dir, "DIR")
        if args.json:
            print_json(meta)
        else:
            summary(args.dir, meta)
        return 0
    from ..config import check_count
    from ..data.prepare import Options, prepare

    check_count("--workers", args.workers, least=0)
    opts = Options(inputs=tuple(args.inputs), out=args.out, tokenizer=args.tokenizer,
                   train_bpe=args.train_bpe, field=args.field, column=args.column,
                   glob=args.glob, val_fraction=args.val_fraction, workers=args.workers,
                   exclude=tuple(e.strip() for e in args.exclude.split(",") if e.strip()),
                   shard_mb=args.shard_mb)
    meta = prepare(opts, log=(lambda s: None) if args.json else print)
    if args.json:
        print_json(meta)
    else:
        summary(args.out, meta, " (up to date)" if meta.get("skipped") else "")
    return 0
