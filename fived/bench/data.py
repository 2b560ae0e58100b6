"""``fived bench data``: is the loader ever the bottleneck? Loader tokens/s against the trainer's.

    fived bench data [--data DIR] [--model small] [--global-batch 16] [--batches 300]
                     [--steps 4] [--min-ratio 50] [--json]

Without ``--data`` it prepares a temporary directory from the built-in corpus (this Python's
standard library source, ``--corpus-mb`` MB, byte tokenizer). Then, on one process:

* loader: ``Loader.batch(step)`` for ``--batches`` consecutive steps, reading the whole global
  batch (``--global-batch`` × seq_len tokens, the most any one rank reads), synchronously, and
  the same through the prefetch thread (``get``): tokens / second;
* trainer: ``Trainer.step`` of the ``--model`` preset on that directory, one rank, after one
  warm-up step, median over ``--steps`` steps: tokens / second, and the seconds ``get`` waited
  for the prefetch thread during those steps.

The ratio loader / trainer must be at least ``--min-ratio`` (default 50; exit status 1 if not).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..ui import flags
from ..ui.args import Parser
from . import schema


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived bench data", description="Loader tokens/s against the trainer's tokens/s "
        "(one process); the loader must be --min-ratio times faster.",
        epilog="example: fived bench data --model small --batches 300 --steps 4")
    ap.add_argument("--data", default="", metavar="DIR",
                    help="a prepared directory (default: a temporary one from the built-in corpus)")
    flags.add_flag(ap, "model", default="small")
    flags.add_flag(ap, "global_batch", default=16)
    flags.add_flag(ap, "corpus_mb", default=4.0)
    ap.add_argument("--batches", type=int, default=300, help="loader batches timed (default 300)")
    flags.add_flag(ap, "steps", default=4, help="trainer steps timed after one warm-up")
    ap.add_argument("--min-ratio", type=float, default=50.0,
                    help="loader/trainer tokens/s ratio required (default 50)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON too")
    return ap


def _time_loader(loader: Any, n: int, threaded: bool) -> float:
    fetch = loader.get if threaded else loader.batch
    fetch(0)
    t0 = time.perf_counter()
    for s in range(1, n + 1):
        fetch(s)
    dt = time.perf_counter() - t0
    loader.close()
    return n * loader.batch_size * loader.seq_len / dt


def run(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    from ..config import ConfigError, ParallelConfig, TrainConfig, preset
    from ..data.loader import Loader
    from ..data.meta import model_for_data
    from ..data.prepare import Options, prepare

    if args.batches < 1 or args.steps < 1:
        raise ConfigError(["--batches and --steps must be >= 1"])
    tmp = None
    data = args.data
    if not data:
        from ..train.data import corpus_bytes

        tmp = tempfile.TemporaryDirectory(prefix="fived-bench-data-")
        src = Path(tmp.name) / "corpus.txt"
        src.write_bytes(corpus_bytes(args.corpus_mb))
        log(f"preparing {args.corpus_mb:g} MiB of the built-in corpus (byte tokenizer) ...")
        prepare(Options((str(src),), str(Path(tmp.name) / "data"), val_fraction=0.0),
                lambda s: None)
        data = str(Path(tmp.name) / "data")
    try:
        model = model_for_data(preset(args.model), data)
        L, B = model.seq_len, args.global_batch
        ld = lambda: Loader(data, "train", L, B, seed=1)  # noqa: E731
        sync = _time_loader(ld(), args.batches, threaded=False)
        threaded = _time_loader(ld(), args.batches, threaded=True)
        log(f"loader: {sync:,.0f} tokens/s reading, {threaded:,.0f} tokens/s through the "
            f"prefetch thread ({B}×{L} tokens a batch, {args.batches} batches)")
        from ..train.trainer import Trainer

        train = replace(TrainConfig(), global_batch=B, steps=args.steps + 1, data=data)
        t = Trainer(model, ParallelConfig(), train, 0, 1)
        log(f"trainer: {model.name} (vocab {model.vocab}), 1 rank, {args.steps + 1} steps ...")
        t.step(0)  # warm-up
        wait0 = t.loader.wait_s
        secs = [t.step(s)["seconds"] for s in range(1, args.steps + 1)]
        waited = t.loader.wait_s - wait0
        t.close()
    finally:
        if tmp is not None:
            tmp.cleanup()
    trainer_tps = B * L / statistics.median(secs)
    ratio = min(sync, threaded) / trainer_tps
    return {"model": model.name, "seq_len": L, "global_batch": B, "loader_tokens_per_s": sync,
            "loader_prefetch_tokens_per_s": threaded, "trainer_tokens_per_s": trainer_tps,
            "ratio": ratio, "min_ratio": args.min_ratio, "ok": ratio >= args.min_ratio,
            "trainer_wait_s": waited, "trainer_step_s": sum(secs)}


@schema.json_stdout
def main(argv: list[str]) -> int:
    args = flags.parse(parser(), argv)
    from rich.console import Console
    from rich.table import Table

    print(f"fived bench data: loader vs trainer, model {args.model}, global batch "
          f"{args.global_batch}", flush=True)
    res = run(args)
    con = Console(highlight=False)
    t = Table(title="fived bench data — tokens/s, one process", header_style="bold")
    t.add_column("what")
    t.add_column("tokens/s", justify="right")
    t.add_row("loader, read on the step's thread", f"{res['loader_tokens_per_s']:,.0f}")
    t.add_row("loader, through the prefetch thread", f"{res['loader_prefetch_tokens_per_s']:,.0f}")
    t.add_row(f"trainer, {res['model']}, 1 rank", f"{res['trainer_tokens_per_s']:,.0f}")
    t.add_row("ratio loader / trainer (slower loader)", f"{res['ratio']:,.0f}×")
    con.print(t)
    con.print(f"the training steps waited {1000 * res['trainer_wait_s']:.2f} ms for data in "
              f"{res['trainer_step_s']:.2f} s; required ratio >= {res['min_ratio']:g}: "
              f"{'yes' if res['ok'] else 'NO'}")
    if args.json:
        schema.emit(document(argv, res))
    return 0 if res["ok"] else 1


def document(argv: list[str], res: dict[str, Any]) -> dict[str, Any]:
    """The ``fived.bench`` document: one variant (a global batch of tokens delivered), the
    trainer's step its peer, the loader read on the step's thread and through the prefetch
    thread; a row's ``ratio`` is its seconds per batch over the trainer's (the loader must stay
    below 1 / --min-ratio)."""
    tokens = res["global_batch"] * res["seq_len"]
    variant = f"batch of {tokens} tokens"
    rows = [schema.row(variant, f"trainer {res['model']}, 1 rank",
                       tokens / res["trainer_tokens_per_s"], peer=True,
                       tokens_per_s=res["trainer_tokens_per_s"],
                       waited_s=res["trainer_wait_s"]),
            schema.row(variant, "loader", tokens / res["loader_tokens_per_s"],
                       tokens_per_s=res["loader_tokens_per_s"]),
            schema.row(variant, "loader, prefetch thread",
                       tokens / res["loader_prefetch_tokens_per_s"],
                       tokens_per_s=res["loader_prefetch_tokens_per_s"])]
    return schema.document("data", argv, rows, settings={
        "model": res["model"], "seq_len": res["seq_len"], "global_batch": res["global_batch"],
        "min_ratio": res["min_ratio"]}, extra={"ratio": res["ratio"], "ok": res["ok"]})
