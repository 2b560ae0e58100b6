"""``fived export DIR --hf OUT``: a fived checkpoint as a Hugging Face model directory.

Writes ``config.json`` (``LlamaForCausalLM``, ``Qwen2ForCausalLM`` with q/k/v biases,
``Qwen3ForCausalLM`` with q/k norms, or ``MixtralForCausalLM``), safetensors shards and
``model.safetensors.index.json``; ``transformers`` loads it with ``from_pretrained(OUT)``. The
weights are the fp32 masters where the checkpoint has them; ``--dtype`` casts. OUT must be
new or empty: nothing is overwritten. The tokenizer the checkpoint was trained with (the byte
vocabulary, or its --data directory's) goes beside them as ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json`` (``AutoTokenizer.from_pretrained(OUT)``,
``fived generate --hf OUT``); every file is written mode 0644.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError
from ..ui import report
from ..ui.args import Parser


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived export", description="Export a fived checkpoint (any layout) to a Hugging "
        "Face directory: safetensors shards + index + config.json.",
        epilog="example:\n  fived export runs/ck --hf runs/hf\n  python -c \"import transformers as t;"
        " t.AutoModelForCausalLM.from_pretrained('runs/hf')\"",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", metavar="DIR", help="a save directory (newest checkpoint) or DIR/step-N")
    ap.add_argument("--hf", required=True, metavar="OUT", help="the directory to write (new or empty)")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                    help="the exported weights' dtype (default: the checkpoint's compute dtype)")
    ap.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="largest safetensors file, as transformers' save_pretrained takes it: "
                         "5GB, 500MB, 2GiB or bytes (default: 5GB); export holds one shard at "
                         "a time in memory, never the whole model")
    ap.add_argument("--tokenizer", default=None, metavar="SPEC",
                    help="the tokenizer to write beside the weights: 'byte', a tokenizer.json or "
                         "a data directory (default: the one the checkpoint was trained with)")
    return ap


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5·10⁹ bytes (transformers' units: KB/MB/GB decimal, KiB/MiB/GiB binary)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in UNITS or float(m.group(1)) <= 0:
        raise ConfigError([f"--max-shard-size {text!r}: give a positive size such as 5GB, "
                           "500MB, 2GiB or a number of bytes"])
    return max(1, int(float(m.group(1)) * UNITS[m.group(2).upper()]))


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from ..checkpoint.storage import resolve, verify

    ckpt = resolve(args.dir, "fived export")
    out = Path(args.hf)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError([f"fived export --hf {args.hf}: exists and is not an empty directory "
                           "(nothing is overwritten)"])
    max_bytes = parse_size(args.max_shard_size)
    print(f"fived export {ckpt} -> {out} ...", flush=True)
    man = verify(ckpt, "fived export")
    from ..checkpoint import hf
    from ..checkpoint.convert import DTYPES, export_hf, model_of

    cfg = model_of(man)
    hf.hf_config(cfg)  # refuses what transformers cannot represent, before reading tensors
    from ..data.tokenizer import hf_files
    from .generate import _checkpoint_tokenizer

    try:
        tok = _checkpoint_tokenizer(man, args.tokenizer, ckpt, "fived export")
    except ConfigError as e:
        if args.tokenizer:
            raise
        tok = None  # an imported checkpoint: weights only; said in one line below
        why = e.problems[0]
    rows = export_hf(ckpt, man, out, DTYPES[args.dtype] if args.dtype else None, max_bytes,
                     lambda i, n: print(f"  shard {i}/{n} written", flush=True))
    if cfg.is_moe and cfg.capacity_factor > 0:
        print(f"note: trained with capacity_factor {cfg.capacity_factor:g} (tokens over capacity "
              "dropped); transformers' Mixtral is dropless, so its outputs differ where fived "
              "dropped tokens", flush=True)
    if tok is not None:
        for name, text in hf_files(tok, cfg.seq_len).items():
            (out / name).write_text(text)
    else:
        print(f"note: no tokenizer written ({why})", flush=True)
    for f in out.iterdir():  # safetensors writes 0600; a model directory is for sharing
        f.chmod(0o644)
    con = report.console()
    t = report.table(f"{out} ({hf.hf_config(cfg)['architectures'][0]}, step {man['step']})",
                     [("file", "l"), ("tensors", "r"), ("bytes", "r")])
    for f, n, b in rows:
        t.add_row(f, str(n), report.fmt_b(b))
    t.add_row("config.json", "", "")
    if tok is not None:
        t.add_row(f"tokenizer.json ({tok.kind}, {tok.vocab} symbols)", "", "")
    report.show(con, t)
    return 0
