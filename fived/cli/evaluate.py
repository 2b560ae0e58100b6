"""``fived eval --from DIR --data DIR``: the loss and perplexity of a checkpoint, no training.

The model is the checkpoint's (its manifest's ``[model]``); the layout is the flags' (any
layout, whatever the checkpoint was trained on: ``--tp 2``, ``--pp 2 --micro-batches 2``, ...;
unset degrees are 1, the precision is the checkpoint's unless --precision is given). Every
rank loads its pieces of the weights (``fived.checkpoint.load``, weights only) and runs
``--batches`` global batches of ``--split`` forward only (``Trainer.evaluate``, docs/eval.md):
the same sequences a training run's ``--eval-every`` reads, so with the checkpoint's global
batch (the default) the loss equals the ``val_loss`` that run reported for these weights.

``--data`` is required: the built-in corpus has no validation split. Its tokenizer must be the
checkpoint's (a checkpoint of the built-in corpus has none: it is refused); a checkpoint
imported from Hugging Face (no data recorded) takes any data whose tokenizer fits its vocab.
Bad input is one ConfigError naming the flag, exit 2, before any rank starts; nothing here
imports torch before the ranks do (``--help`` is fast).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields, replace

from ..config import ConfigError, ModelConfig, TrainConfig, fill_dp, validate
from ..ui import flags
from ..ui.args import Parser

EPILOG = """examples:
  fived train --data data/notes --eval-every 10 --save-dir ck --steps 50
  fived eval --from ck --data data/notes                  # newest step-N, one rank
  fived eval --from ck/step-20 --data data/notes --tp 2 --batches 8
  fived eval --from ck --data data/notes --split train --pp 2 --micro-batches 2 --json
"""


def layout_flags() -> tuple[str, ...]:
    return tuple(f.name for f in flags.table() if f.group == "layout")


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived eval", description="Evaluate a fived checkpoint: loss and perplexity on a\n"
        "split of a prepared data directory, forward only, at any layout.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    e = ap.add_argument_group("evaluation")
    e.add_argument("--from", dest="src", required=True, metavar="DIR",
                   help="a save directory (its newest complete step-N) or a step-N directory")
    e.add_argument("--data", default="", metavar="DIR",
                   help="a prepared data directory (`fived data prepare`) with the checkpoint's "
                        "tokenizer; required (the built-in corpus has no validation split)")
    e.add_argument("--split", default="val", metavar="NAME",
                   help="the split to evaluate, e.g. val or train (default: val)")
    e.add_argument("--batches", type=int, default=None, metavar="N",
                   help="global batches to evaluate (default: the checkpoint's --eval-batches)")
    e.add_argument("--json", action="store_true",
                   help="print one JSON document on stdout (progress lines go to stderr)")
    e.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="collective timeout in seconds (default: 120)")
    flags.add_config_flags(ap, groups=("layout", "run"), only=layout_flags() + ("global_batch",),
                           notes={"layout": "unset degrees are 1 (world = their product); "
                                            "--precision defaults to the checkpoint's",
                                  "run": "--global-batch defaults to the checkpoint's"})
    return ap


def _checkpoint(src: str):
    from ..checkpoint.storage import resolve, verify

    ckpt = resolve(src, "--from")
    return ckpt, verify(ckpt, "--from")


def _data(args, model: ModelConfig, man: dict, batches_default: int) -> int:
    """Every check of --data, --split and --batches against the checkpoint; the batches."""
    from ..data.meta import read_data_meta

    if args.batches is not None and args.batches < 1:
        raise ConfigError([f"--batches {args.batches}: give the number of global batches to "
                           "evaluate, N >= 1"])
    saved = man.get("data") or {}
    if not args.data:
        hint = (f" (the checkpoint was trained on --data {saved['dir']})"
                if saved.get("source") == "data" else "")
        raise ConfigError([f"--data DIR is needed: the built-in corpus has no validation "
                           f"split{hint}"])
    meta = read_data_meta(args.data, "--data")  # a directory, or a mixture of them
    mine = meta["tokenizer"]["hash"]
    if saved.get("source") == "builtin":
        raise ConfigError([f"--data {args.data}: the checkpoint was trained on the built-in "
                           "corpus (raw bytes, no tokenizer); its tokenizer is not this "
                           "data's"])
    if saved.get("source") in ("data", "mixture") and saved.get("tokenizer_hash") != mine:
        raise ConfigError([f"--data {args.data}: its tokenizer (hash {mine[:12]}) is not the "
                           f"checkpoint's (hash {str(saved.get('tokenizer_hash'))[:12]}, "
                           f"trained on {saved.get('dir')}); evaluate on data prepared with "
                           "the same tokenizer"])
    if int(meta["vocab"]) > model.vocab:
        raise ConfigError([f"--data {args.data}: the tokenizer has {meta['vocab']} symbols but "
                           f"the checkpoint's model has a vocab of {model.vocab}"])
    splits = meta.get("splits", {})
    if args.split not in splits:
        raise ConfigError([f"--split {args.split}: {args.data} has no such split; it has "
                           f"{', '.join(sorted(splits))}"])
    n = int(splits[args.split]["tokens"])
    if n < model.seq_len + 1:
        raise ConfigError([f"--split {args.split}: {args.data} has {n} tokens in it, fewer "
                           f"than one sequence of {model.seq_len + 1}"])
    return args.batches if args.batches is not None else batches_default


def configs(args):
    """(model, layout, train, world, checkpoint, batches), every check done (no torch)."""
    res = flags.configs(args)
    ckpt, man = _checkpoint(args.src)
    cfg = man["config"]
    names = {f.name for f in fields(ModelConfig)}
    model = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in cfg["model"].items() if k in names})
    saved_train = cfg.get("train", {})
    batches = _data(args, model, man, int(saved_train.get("eval_batches", 4)))
    par = res.par
    for k in ("precision", "master_weights"):  # the checkpoint's numerics unless given
        if f"parallel.{k}" not in res.given and k in cfg.get("parallel", {}):
            par = replace(par, **{k: cfg["parallel"][k]})
    par, world = fill_dp(par, True)
    gb = (res.train.global_batch if "train.global_batch" in res.given
          else int(saved_train.get("global_batch", res.train.global_batch)))
    train = replace(TrainConfig(), model=model.name, global_batch=gb, data=args.data,
                    eval_batches=batches, seed=int(saved_train.get("seed", 1234)),
                    # the attention the checkpoint was trained with (--doc-mask: documents)
                    doc_mask=bool(saved_train.get("doc_mask", False)),
                    doc_positions=str(saved_train.get("doc_positions", "continue")),
                    eos_target=str(saved_train.get("eos_target", "count")))
    validate(model, par, train, world)
    from ..config import check_runtime_model

    check_runtime_model(model)
    return model, par, train, world, ckpt, batches, man


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.timeout <= 0:
        raise ConfigError([f"--timeout must be > 0 seconds (got {args.timeout:g})"])
    model, par, train, world, ckpt, batches, man = configs(args)
    if args.print_config:
        from ..ui.flags import Resolved

        return flags.print_config(Resolved(model, par, train, frozenset()),
                                  f"fived eval: {world} rank(s)")
    from ..ranks.launch import torchrun_env

    env = torchrun_env()
    say = sys.stderr if args.json else sys.stdout
    speak = not env or env[0] == 0
    if speak:
        from ..ui.report import header

        print(header([f"fived eval: {ckpt} (step {man['step']})", model.name, par.describe(),
                      f"{world} rank(s)", f"{batches} batch(es) of "
                      f"{train.global_batch}×{model.seq_len} tokens",
                      f"--split {args.split} of {args.data}"]), file=say, flush=True)
    from ..train.trainer import eval_rank

    rank_args = (model, par, train, str(ckpt), args.split, batches,
                 "stderr" if args.json else "stdout")
    if env:
        from ..ranks.launch import run_torchrun

        if env[1] != world:
            raise ConfigError([f"the layout {par.describe()} needs {world} rank(s), torchrun "
                               f"started {env[1]}"])
        out = run_torchrun(eval_rank, rank_args, args.timeout)
    else:
        from ..ranks.launch import RankFailure, run_local

        try:
            out = run_local(eval_rank, world, rank_args, timeout=args.timeout * 50,
                            collective_timeout=args.timeout)[0]
        except RankFailure as e:
            print(f"fived eval: rank {e.rank} failed — every rank was stopped.\n{e.detail}",
                  file=sys.stderr)
            return 1
    if not speak:
        return 0
    doc = {"checkpoint": str(ckpt), "step": int(man["step"]), "model": model.name,
           "layout": par.describe(), "world": world, "data": args.data, "split": args.split,
           "batches": batches, "global_batch": train.global_batch, "seq_len": model.seq_len,
           **{k: out[k] for k in ("loss", "ppl", "tokens", "seconds", "tokens_per_s")},
           **({"loss_by_source": out["loss_by_source"]} if "loss_by_source" in out else {})}
    if args.json:
        from ..ui.report import print_json

        print_json(doc)
        return 0
    from ..ui import report

    con = report.console()
    t = report.table(f"step {doc['step']} · {args.split} · {par.describe()}",
                     [("loss", "r"), ("ppl", "r"), ("tokens", "r"), ("seconds", "r"),
                      ("tokens/s", "r")])
    t.add_row(f"{doc['loss']:.4f}", f"{doc['ppl']:.2f}", f"{doc['tokens']:,}",
              f"{doc['seconds']:.2f}", report.fmt_n(doc["tokens_per_s"]))
    report.show(con, t)
    for name, v in doc.get("loss_by_source", {}).items():  # a mixture: each source alone
        print(f"source {name}: loss {v:.4f}, perplexity {math.exp(min(v, 700.0)):.2f}")
    return 0
