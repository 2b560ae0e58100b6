"""``fived export DIR --hf OUT``: a fived checkpoint as a Hugging Face model directory.

Writes ``config.json`` (``LlamaForCausalLM`` or ``MixtralForCausalLM``), safetensors shards and
``model.safetensors.index.json``; ``transformers`` loads it with ``from_pretrained(OUT)``. The
weights are the fp32 masters where the checkpoint has them; ``--dtype`` casts. OUT must be
new or empty: nothing is overwritten.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError
from . import report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fived export", description="Export a fived checkpoint (any layout) to a Hugging "
        "Face directory: safetensors shards + index + config.json.",
        epilog="example:\n  fived export runs/ck --hf runs/hf\n  python -c \"import transformers as t;"
        " t.AutoModelForCausalLM.from_pretrained('runs/hf')\"",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", metavar="DIR", help="a save directory (newest checkpoint) or DIR/step-N")
    ap.add_argument("--hf", required=True, metavar="OUT", help="the directory to write (new or empty)")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                    help="the exported weights' dtype (default: the checkpoint's compute dtype)")
    ap.add_argument("--shard-gb", type=float, default=2.0, metavar="GB",
                    help="largest safetensors file (default: 2)")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from ..checkpoint.storage import resolve, verify

    ckpt = resolve(args.dir, "fived export")
    out = Path(args.hf)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError([f"fived export --hf {args.hf}: exists and is not an empty directory "
                           "(nothing is overwritten)"])
    if args.shard_gb <= 0:
        raise ConfigError([f"--shard-gb must be > 0 (got {args.shard_gb:g})"])
    print(f"fived export {ckpt} -> {out} ...", flush=True)
    man = verify(ckpt, "fived export")
    from ..checkpoint import hf
    from ..checkpoint.convert import DTYPES, model_of, whole_model

    cfg = model_of(man)
    hf.hf_config(cfg)  # refuses what transformers cannot represent, before reading tensors
    tensors = whole_model(ckpt, man, DTYPES[args.dtype] if args.dtype else None)
    rows = hf.write_hf(tensors, cfg, out, int(args.shard_gb * 2**30))
    if cfg.is_moe and cfg.capacity_factor > 0:
        print(f"note: trained with capacity_factor {cfg.capacity_factor:g} (tokens over capacity "
              "dropped); transformers' Mixtral is dropless, so its outputs differ where fived "
              "dropped tokens", flush=True)
    con = report.console()
    t = report.table(f"{out} ({hf.hf_config(cfg)['architectures'][0]}, step {man['step']})",
                     [("file", "l"), ("tensors", "r"), ("bytes", "r")])
    for f, n, b in rows:
        t.add_row(f, str(n), report.fmt_b(b))
    t.add_row("config.json", "", "")
    report.show(con, t)
    return 0
