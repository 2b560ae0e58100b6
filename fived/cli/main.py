"""fived's command line: train | eval | data | grid | plan | ledger | bench | figures | report |
checkpoint | export | import | generate.

One module per command (``fived.cli.train``, ``grid``, ``plan``, ``ledger``), one flag set
shared by all (``fived.ui.flags``), one ``fived.config.validate``. ``fived bench NAME`` and
``fived figures NAME`` run ``fived.bench.NAME`` / ``fived.viz.NAME``; ``fived report`` runs
``fived.viz._page`` (the HTML page of the figures; ``fived.ui.report`` is the table formatter).

The error rule: bad input is one ``ConfigError`` naming the flag, printed without a traceback,
exit code 2, before any rank starts or any file is written.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable

from ..config import ConfigError
from ..ui.args import Parser

EXAMPLES = """examples:
  fived train                                  # tiny model, 4 local ranks (dp=4), 50 steps
  fived train --dp 2 --steps 5 --metrics-out a.jsonl
  fived train --tp 2 --dp 2 --zero 1           # 2D layout on 4 ranks
  fived train --config run.toml --steps 10     # TOML first, flags override it
  fived train --tp 2 --print-config            # the effective configuration, as TOML
  fived data prepare notes/ --train-bpe 4096 --out data/notes && fived train --data data/notes
  torchrun --nproc-per-node 8 -m fived train --model small --pp 2 --tp 2 --dp 2
  fived grid --tp 2 --pp 2 --dp 2 --gpus-per-node 4
  fived ledger --model llama2-7b --gpus 8 --precision bf16 --zero 3
  fived plan --model llama3-70b --gpus 64 --precision bf16 --global-batch-tokens 4M
  fived bench comm --nprocs 2 -b 1K -e 16M -f 4 --json
  fived figures schedule --schedule interleaved --pp 4 --micro-batches 8
  fived figures all --out figs --quick         # every figure: PNG + SVG + JSON + command
  fived report --out report --from figs        # one offline HTML page of them
  fived train --save-dir ck --save-every 10 && fived train --resume ck --tp 2 --pp 2
  torchrun --max-restarts 3 ... -m fived train --save-dir ck --save-every 50 --resume auto  # start = restart
  fived eval --from ck --data data/notes --tp 2   # loss/perplexity of a checkpoint
  fived checkpoint inspect ck        fived export ck --hf hf_out     fived import hf_out --save-dir ck2
  fived generate --from ck --prompt "def " --max-new-tokens 64 --tp 2
"""

COMMANDS = {
    "train": "train a model on local ranks or under torchrun",
    "eval": "loss and perplexity of a checkpoint on a data split, forward only, any layout",
    "data": "prepare text for `fived train --data DIR` (fived data prepare|info)",
    "grid": "print every rank's coordinates and groups",
    "plan": "search the layouts of a model on a cluster, fastest first",
    "ledger": "memory / FLOPs / traffic / time breakdown of one layout",
    "bench": "benchmarks against PyTorch's own: {}",
    "figures": "figures: {}",
    "report": "one self-contained HTML page of the figures (or of one layout)",
    "checkpoint": "inspect a checkpoint: step, layout, tensors, bytes per rank vs the ledger",
    "export": "export a checkpoint to a Hugging Face directory (safetensors + config.json)",
    "import": "import a local Hugging Face Llama/Mixtral directory as a checkpoint",
    "generate": "sample text from a checkpoint or a HF directory (KV cache, any --tp)",
}


def modules(package: str) -> list[str]:
    """The runnable modules of a package (``fived.bench`` ...), without importing them."""
    pkg = importlib.import_module(package)
    helpers = getattr(pkg, "NOT_COMMANDS", ())  # shared code, no main: fived.bench's harness
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(pkg.__path__)
                  if not m.name.startswith("_") and m.name not in helpers)


def run(cmd: str, fn: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """Run one command under the error rule."""
    try:
        return int(fn(argv) or 0)
    except ConfigError as e:
        from ..ui.report import fold

        lines = [f"fived {cmd}: ConfigError: invalid configuration "
                 f"({len(e.problems)} problem(s)):"]
        lines += [fold(f"  - {p}") for p in e.problems]
        print("\n".join(lines), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _dispatch(package: str, what: str, argv: list[str]) -> int:
    names = modules(package)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: fived {what} NAME [options]\n\n{what}: {', '.join(names)}\n"
              f"fived {what} NAME --help says what each one takes "
              f"(e.g. fived {what} {names[0]} --help)")
        return 0
    name = argv[0].replace("-", "_")
    if argv[0] not in names:
        from ..config import did_you_mean
        from ..ui.report import fold

        print(fold(f"fived {what}: no {what} named {argv[0]!r}{did_you_mean(argv[0], names)} "
                   f"(choose one of {', '.join(names)})", indent="  "), file=sys.stderr)
        return 2
    try:
        mod = importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{name}":
            raise  # a real import error inside the module: show it
        print(f"fived {what}: no {what} named {argv[0]!r}; choose one of {', '.join(names)}",
              file=sys.stderr)
        return 2
    return run(f"{what} {argv[0]}", mod.main, argv[1:])


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived", description="Train transformers with data, tensor, pipeline, context and "
        "expert parallelism, and account for every byte. Every command takes the same model, "
        "layout and run flags (and --config FILE.toml, --print-config); see `fived CMD --help`.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="{" + ",".join(COMMANDS) + "}")
    for cmd, text in COMMANDS.items():
        if cmd in ("bench", "figures"):
            text = text.format(", ".join(modules("fived.bench" if cmd == "bench" else "fived.viz")))
        sub.add_parser(cmd, help=text, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("bench", "figures"):
        return _dispatch("fived.bench" if argv[0] == "bench" else "fived.viz", argv[0], argv[1:])
    if argv and argv[0] == "report":  # the page lives with the figures (fived.viz._page)
        return run("report", importlib.import_module("fived.viz._page").main, argv[1:])
    if argv and argv[0] in ("train", "eval", "data", "grid", "plan", "ledger", "checkpoint",
                            "export", "import", "generate"):
        name = {"import": "hf_import", "eval": "evaluate"}.get(argv[0], argv[0])
        mod = importlib.import_module(f"{__package__}.{name}")
        return run(argv[0], mod.main, argv[1:])
    ap = parser()
    ap.parse_args(argv)  # --help, or an unknown command: argparse says so (exit 0 / 2)
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
