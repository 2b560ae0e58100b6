"""``fived import HF_DIR --save-dir DIR``: a local Hugging Face Llama / Qwen2 / Qwen3 / Mixtral
directory (config.json + safetensors) as a fived checkpoint ``DIR/step-000000`` (parameters only), which
``fived train --resume DIR`` then loads into any layout (the optimizer starts fresh).
``fived train --init-from HF_DIR`` does the same without writing a checkpoint. Only
safetensors are read (no pickles); nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError
from ..ui import report
from ..ui.args import Parser


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived import", description="Import a local Hugging Face Llama/Qwen2/Qwen3/Mixtral directory "
        "into a fived checkpoint.", epilog="example:\n  fived import runs/hf --save-dir runs/ck"
        "\n  fived train --resume runs/ck --tp 2 --pp 2 --steps 10",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", metavar="HF_DIR", help="config.json + *.safetensors")
    ap.add_argument("--save-dir", required=True, metavar="DIR",
                    help="where to write DIR/step-000000 (must hold no checkpoint yet)")
    ap.add_argument("--seq-len", type=int, default=None, metavar="N",
                    help="tokens per sequence the checkpoint's config records (default: 64)")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="the dtype stored (default: fp32)")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from ..checkpoint import hf

    hf.model_config(hf.read_config(args.hf_dir, "fived import"), "fived import")
    root = Path(args.save_dir)
    if root.exists() and (not root.is_dir() or any(p.name.startswith("step-")
                                                    for p in root.iterdir())):
        raise ConfigError([f"fived import --save-dir {args.save_dir}: already holds checkpoints "
                           "(or is a file); nothing is overwritten"])
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError([f"--seq-len must be >= 1 (got {args.seq_len})"])
    print(f"fived import {args.hf_dir} -> {root} ...", flush=True)
    from ..checkpoint.convert import import_hf

    ckpt, cfg, tensors = import_hf(args.hf_dir, root, args.seq_len, args.dtype)
    con = report.console()
    t = report.table(f"{ckpt}", [("model", "l"), ("layers", "r"), ("hidden", "r"),
                                 ("experts", "r"), ("tensors", "r"), ("bytes", "r")])
    t.add_row(cfg.name, str(cfg.layers), str(cfg.hidden), str(cfg.experts), str(len(tensors)),
              report.fmt_b(sum(v["bytes"] for v in tensors.values())))
    report.show(con, t)
    print(f"resume it in any layout: fived train --resume {root} [--tp/--pp/--dp/...]")
    return 0
