"""``fived train``: train on local ranks it spawns itself, or under ``torchrun``.

With nothing given it trains the ``tiny`` model on the built-in corpus on 4 local ranks
(dp = 4). The configuration is resolved and validated (``fived.config.validate``, and
``check_outputs`` for --metrics-out) before torch is imported or any rank starts.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from ..config import (
    PREEMPTED_EXIT,
    RESUME_AUTO,
    ConfigError,
    check_count,
    check_outputs,
    check_runtime_model,
    fill_dp,
    validate,
)
from ..data.meta import check_data_run, model_for_data
from ..ranks.launch import torchrun_env
from ..ui import flags
from ..ui.args import Parser
from .main import EXAMPLES


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived train", description="Train a model with any layout of the five dimensions, "
        "on local ranks (gloo on CPU) or under torchrun.", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_config_flags(ap)
    g = ap.add_argument_group("launch", "where the ranks run")
    g.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="local ranks to spawn; without --dp, dp takes what the other degrees leave "
                        "(default: 4 ranks, or the product of the degrees; ignored under torchrun)")
    g.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="collective timeout in seconds: a dead rank stops the others (default: 120)")
    d = ap.add_argument_group("dry run", "one step of chosen ranks of any layout on fake tensors "
                              "(docs/fullscale.md)")
    d.add_argument("--dry-run", action="store_true",
                   help="build and step the --ranks of the layout under FakeTensorMode with the "
                        "fake process group (no memory, no peers); with --metrics-out, a file "
                        "`fived ledger --check` compares")
    d.add_argument("--ranks", default="distinct", metavar="R,R,...|distinct",
                   help="the ranks to dry-run (default: distinct, one rank of every role)")
    d.add_argument("--dry-run-device", default="meta", choices=("meta", "cpu"),
                   help="device of the fake tensors (default: meta, which catches a tensor "
                        "left on the cpu)")
    return ap


def unused_flags(args, res) -> None:
    """A flag given on the command line that would change nothing in this combination: a
    ConfigError naming it (nothing is silently ignored). Only flags: a TOML written by
    --print-config holds every key, used or not."""
    cli = {f.name for f in flags.table() if getattr(args, f.name, None) is not None}
    train, par = res.train, res.par
    p = []
    if not train.save_dir:
        for key, flag in (("save_every", "--save-every"), ("keep", "--keep"),
                          ("async_save", "--async-save")):
            if key in cli:
                p.append(f"{flag} {flags.shown(getattr(train, key))}: checkpoints go to "
                         "--save-dir, and none is given; add --save-dir DIR (or drop "
                         f"{flag})")
    needs = (("schedule", par.pp > 1, "orders a pipeline's micro-batches; add --pp 2 or more"),
             ("cp_mode", par.cp > 1, "is how context parallelism splits attention; add --cp 2 "
              "or more"),
             ("ep_dispatch", par.ep > 1, "is how expert parallelism sends tokens; add --ep 2 or "
              "more"),
             ("zero3_pp_gather", par.zero == 3 and par.pp > 1, "is when ZeRO-3 gathers under a "
              "pipeline; it needs --zero 3 and --pp 2 or more"),
             ("eval_batches", train.eval_every > 0, "sizes the evaluation of --eval-every; add "
              "--eval-every N"))
    for key, used, why in needs:
        if key in cli and not used:
            f = flags.FLAGS[key]
            p.append(f"{f.flag} {flags.shown(getattr(args, key))}: {why} (or drop {f.flag})")
    if not args.dry_run:
        if args.ranks != "distinct":
            p.append(f"--ranks {args.ranks}: picks the ranks of a --dry-run; add --dry-run (or "
                     "drop --ranks)")
        if args.dry_run_device != "meta":
            p.append(f"--dry-run-device {args.dry_run_device}: only a --dry-run uses it; add "
                     "--dry-run (or drop it)")
    if p:
        raise ConfigError(p)


def checkpoint_inputs(model, train, given):
    """--init-from: the model shape is the HF config.json's. --resume: the checkpoint is
    resolved (DIR -> its newest step-N) and verified (sizes, sha256) here, before any rank
    starts; without model flags the model is the checkpoint's, with them it must match (every
    mismatched tensor is listed). --save-dir must be a directory or creatable."""
    from pathlib import Path

    if train.resume == RESUME_AUTO:
        train = resume_auto(train)
    if train.init_from and train.resume:
        raise ConfigError(["--init-from and --resume: give one (a checkpoint already holds "
                           "its weights)"])
    if train.init_from:
        from ..checkpoint.hf import HFSource, model_config, read_config

        model = model_config(read_config(train.init_from, "--init-from"), "--init-from",
                             model.seq_len)
        HFSource(train.init_from, model)  # the headers only: every file there, every shape
    if train.resume:
        from ..checkpoint.convert import model_of, param_shapes
        from ..checkpoint.state import check_compatible
        from ..checkpoint.storage import resolve, verify

        ckpt = resolve(train.resume)
        man = verify(ckpt)
        if "train.model" not in given and not {k for k in given if k.startswith("model.")
                                               and k != "model.seq_len"}:
            model = replace(model_of(man), seq_len=model.seq_len if "model.seq_len" in given
                            else model_of(man).seq_len)
        check_compatible(man, param_shapes(model), model.is_moe, model=model)
        check_resume_data(man, model, train, ckpt)
        train = replace(train, resume=str(ckpt))  # every rank loads this very step
    if train.save_dir and Path(train.save_dir).exists() and not Path(train.save_dir).is_dir():
        raise ConfigError([f"--save-dir {train.save_dir}: exists and is not a directory"])
    return model, train


def check_resume_data(man, model, train, ckpt) -> None:
    """The data a checkpoint was trained on against this run's, before any rank starts: each
    side named (the ranks would refuse the same resume, later and with a traceback)."""
    saved = man.get("data") or {}
    if not saved:  # `fived import`: weights only, any data
        return
    here = f"--resume {ckpt}"
    if saved.get("source") == "builtin":
        if train.data:
            raise ConfigError([f"{here}: trained on the built-in corpus (vocab "
                               f"{man['config']['model'].get('vocab')}), but --data {train.data} "
                               "is other data; resume without --data, or start a fresh run on "
                               "it"])
        mine = {"corpus_mb": train.corpus_mb, "seed": train.seed,
                "global_batch": train.global_batch, "seq_len": model.seq_len}
    else:
        if not train.data:
            raise ConfigError([f"{here}: trained on --data {saved.get('dir')}; give that --data "
                               "(without it this run would read the built-in corpus)"])
        from ..data.meta import read_meta

        meta = read_meta(train.data)
        if int(meta["vocab"]) != int(saved.get("vocab", meta["vocab"])) or (
                saved.get("data_hash") not in (None, meta.get("data_hash"))):
            raise ConfigError([f"{here}: trained on --data {saved.get('dir')} (a tokenizer of "
                               f"{saved.get('vocab')} symbols); --data {train.data} is other "
                               f"data (a tokenizer of {meta['vocab']} symbols); resume with "
                               f"--data {saved.get('dir')}"])
        mine = {"seed": train.seed, "global_batch": train.global_batch,
                "seq_len": model.seq_len}
    flag = {"corpus_mb": "--corpus-mb", "seed": "--seed", "global_batch": "--global-batch",
            "seq_len": "--seq-len"}
    bad = [f"{flag[k]} {v:g}: the checkpoint was trained with {flag[k]} {saved[k]:g}; give "
           f"{flag[k]} {saved[k]:g} to resume it" for k, v in mine.items()
           if k in saved and saved[k] != v]
    if bad:
        raise ConfigError(bad)


def resume_auto(train):
    """``--resume auto``: the newest complete, verified checkpoint under --save-dir, or a fresh
    start (resume ""); one line either way, before torch is imported."""
    from ..checkpoint.storage import newest_valid

    if not train.save_dir:
        raise ConfigError(["--resume auto: resumes the newest checkpoint under --save-dir, but "
                           "no --save-dir is given; add --save-dir DIR"])
    from pathlib import Path

    if Path(train.save_dir).exists() and not Path(train.save_dir).is_dir():
        raise ConfigError([f"--save-dir {train.save_dir}: exists and is not a directory"])
    ckpt, _, skipped = newest_valid(train.save_dir)
    env = torchrun_env()
    if env is None or env[0] == 0:  # under torchrun, rank 0 speaks
        for line in skipped:
            print(f"--resume auto: {line}", flush=True)
        print("--resume auto: " + (f"resuming from {ckpt}" if ckpt else
                                   f"no complete checkpoint under {train.save_dir}: starting "
                                   "fresh"), flush=True)
    return replace(train, resume=str(ckpt) if ckpt else "")


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    res = flags.configs(args)
    train = res.train
    # --data: the vocabulary is the tokenizer's, padded (fived.data.meta.padded_vocab)
    model = model_for_data(res.model, train.data, "model.vocab" in res.given)
    res = replace(res, model=model)
    env = torchrun_env()  # (rank, world, local_rank) under torchrun, else None
    if env:
        world = env[1]
    else:
        if args.nprocs is not None:
            check_count("--nprocs", args.nprocs)
        world = args.nprocs
    if args.timeout <= 0:
        raise ConfigError([f"--timeout must be > 0 seconds (got {args.timeout:g})"])
    unused_flags(args, res)
    par, world = fill_dp(res.par, res.dp_given, world)
    par, precision = train_precision(par)
    res = replace(res, par=par)
    if train.init_from or train.resume or train.save_dir:
        model, train = checkpoint_inputs(model, train, res.given)
    validate(model, par, train, world)
    check_fp8_device(par, args.dry_run)
    check_runtime_model(model)
    check_data_run(model, model.seq_len, train)
    if args.print_config:
        return flags.print_config(res, f"fived train: {world} rank(s) · {precision}")
    check_outputs(train)
    if train.resume and not args.dry_run:
        from pathlib import Path

        from ..checkpoint.storage import read_manifest

        done = int(read_manifest(Path(train.resume))["step"])
        if done >= train.steps:
            if not env or env[0] == 0:
                print(f"fived train: {train.resume} is at step {done}, --steps {train.steps} is "
                      f"reached already: nothing to train (give --steps above {done} to go on)",
                      flush=True)
            return 0
    if train.tensorboard:
        from pathlib import Path

        # TensorBoard makes the directory (and its parents) as log directories go; refuse only
        # a path under a file, or a file where the directory would be
        target = Path(train.tensorboard).resolve()
        ancestor = next(p for p in (target, *target.parents) if p.exists())
        if not ancestor.is_dir():
            raise ConfigError([f"--tensorboard {train.tensorboard}: {str(ancestor)!r} is a file, "
                               "not a directory"])
    if train.doc_len and not (args.dry_run and train.doc_mask):
        raise ConfigError([f"--doc-len {train.doc_len}: gives the documents of a --dry-run "
                           "with --doc-mask; a training run reads its own from --data"])
    if args.dry_run and train.doc_mask:
        from ..data.meta import check_doc_dry_run

        check_doc_dry_run(par, train)
    if args.dry_run:
        if train.memory_trace:
            raise ConfigError(["--memory-trace with --dry-run: the dry run always traces "
                               "(its metrics hold peak_per_rank); drop --memory-trace"])
        return dry_run(model, par, train, args, precision)
    if not env or env[0] == 0:  # under torchrun, rank 0 speaks
        from ..ui.report import header

        print(header([f"fived train: {precision}", model.name, par.describe(),
                      f"{world} rank(s)", f"{train.steps} steps",
                      f"global batch {train.global_batch}×{model.seq_len} tokens"]
                     + ([f"data {train.data} (vocab {model.vocab})"] if train.data else [])),
              flush=True)
        if train.resume:
            print(f"resuming from {train.resume} (any layout: fived.checkpoint, global names)",
                  flush=True)
        if train.init_from:
            print(f"weights from the Hugging Face directory {train.init_from}", flush=True)
        import os

        warn_if_too_big(model, par, train,
                        int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env else world)
    if not env:  # said before torch is imported here (seconds) and the ranks start (more)
        print(f"spawning {world} local rank(s) on gloo (each starts Python and imports torch) "
              "...", flush=True)
    from ..ranks.launch import RankFailure, run_local
    from ..train.metrics import MEASURE_PEAK
    from ..train.trainer import train_rank

    # the MFU denominator: every rank measures its matmul peak at once, the peak is the sum
    # (fived.train.trainer.measure_world_peak)
    peak = MEASURE_PEAK
    if env:
        from ..ranks.launch import run_torchrun

        out = run_torchrun(train_rank, (model, par, train, True, peak), args.timeout)
        return end_status(out)
    from ..config import preempt_signal_names

    try:
        outs = run_local(train_rank, world, (model, par, train, True, peak),
                         timeout=args.timeout * 50, collective_timeout=args.timeout,
                         forward_signals=preempt_signal_names(train.preempt_signals)[0])
    except RankFailure as e:
        print(f"fived train: rank {e.rank} failed — every rank was stopped.\n{e.detail}",
              file=sys.stderr)
        return 1
    if train.metrics_out:
        print(f"metrics: {train.metrics_out}")
    return end_status(outs[0])


def check_fp8_device(par, dry_run: bool) -> None:
    """``--fp8`` needs ``torch._scaled_mm`` where the ranks compute (the CPU build; CUDA from
    compute capability 8.9): one ConfigError before any rank starts. The dry run computes
    nothing and passes."""
    if par.fp8 == "none" or dry_run:
        return
    from ..model import fp8 as fp8_mod
    from ..ranks.launch import cuda_expected

    device = "cuda" if cuda_expected() else "cpu"
    if not fp8_mod.fp8_matmul_available(device):
        raise ConfigError([f"--fp8 {par.fp8}: this {device} has no fp8 matmul "
                           "(torch._scaled_mm runs on the CPU build and on CUDA GPUs of compute "
                           "capability 8.9 and up: Ada, Hopper, Blackwell); drop --fp8"])


def train_precision(par):
    """``--precision auto`` for ``fived train`` (``fived.config.resolve_precision``): bf16 when
    the ranks compute on a cuda device, fp32 on the cpu; resolved here, once, so every rank, the
    metrics file and the checkpoints' manifests record what ran."""
    from ..config import AUTO, resolve_precision

    if par.precision != AUTO:
        return resolve_precision(par, False, "")
    from ..ranks.launch import cuda_expected

    gpu = cuda_expected()
    return resolve_precision(par, gpu, "cuda" if gpu else "cpu")


def end_status(summary) -> int:
    """0: trained; 75 (``PREEMPTED_EXIT``): a preemption signal, saved, resumable; 1: stopped
    after --max-bad-steps non-finite steps in a row (the message is printed by rank 0)."""
    if summary.get("preempted") is not None:
        return PREEMPTED_EXIT
    return 1 if summary.get("stopped") else 0



def available_per_rank(local_ranks: int) -> tuple[float, str]:
    """(bytes one rank can have, what that is): a GPU's memory where torch sees one, else this
    machine's available memory (``MemAvailable``) shared by its ``local_ranks``."""
    from ..ranks.launch import cuda_expected

    if cuda_expected():  # without importing torch where plainly no GPU is here (the cpu)
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory), "one GPU's memory"
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return float("inf"), "unknown"
    return avail / max(local_ranks, 1), f"available memory / {local_ranks} local rank(s)"


def warn_if_too_big(model, par, train, local_ranks: int) -> bool:
    """One warning line when the ledger's largest rank (states + activations + buffers) is
    more than a rank can have; printed before any rank allocates. True when it warned."""
    from ..ledger.memory import fmt_bytes, largest_rank
    from ..ledger.traffic import micro_batch_size

    need = largest_rank(model, par, micro_batch_size(par, train.global_batch),
                        optimizer=train.optimizer).total
    have, what = available_per_rank(local_ranks)
    if need <= have:
        return False
    print(f"warning: the ledger gives the largest rank {fmt_bytes(need)}, more than a rank can "
          f"have here ({fmt_bytes(have)}: {what}); it may run out of memory", file=sys.stderr,
          flush=True)
    return True


def dry_run(model, par, train, args: argparse.Namespace, precision: str = "") -> int:
    """``--dry-run``: the named ranks, one after the other, in this process."""
    import time

    from ..train.dryrun import parse_ranks

    ranks = parse_ranks(args.ranks, par)  # a ConfigError (exit 2) before torch is imported
    from ..ui.report import header

    print(header([f"fived train --dry-run: {precision or par.precision}", model.name,
                  par.describe(), f"{par.world_size} rank(s)",
                  f"global batch {train.global_batch}×{model.seq_len} tokens",
                  f"ranks {','.join(map(str, ranks))} on fake {args.dry_run_device} tensors"]),
          flush=True)
    t0 = time.perf_counter()
    from ..train.dryrun import dry_run as run

    out = run(model, par, train, ranks, args.dry_run_device, train.metrics_out)
    print(f"{len(ranks)} rank(s) in {time.perf_counter() - t0:.1f} s; values are not computed "
          f"(loss NaN; MoE routing uniform)")
    if train.metrics_out:
        print(f"metrics: {train.metrics_out}  (check: fived ledger --check {train.metrics_out})")
    return 0 if out else 1
