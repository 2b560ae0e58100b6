"""``fived plan``: search the layouts of a model on a cluster; rank those that fit.

The model, precision and global batch come from the shared flags (or ``--config``) with the
same defaults as ``fived train``; the layouts are the search's, each checked by the same
``fived.config.validate`` (so a layout the runtime refuses is never proposed). Progress goes
to stderr always: a bar on a terminal, a line every few seconds elsewhere.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

from ..config import (
    DEFAULT_WORLD,
    DIMS,
    OPTIMIZERS,
    RECOMPUTE,
    SCHEDULES,
    ConfigError,
    ParallelConfig,
    check_count,
    check_values,
    resolve_precision,
    validate,
)
from ..ui import flags, report
from ..ui.args import Parser
from ..ui.report import fmt_b, fmt_n, fmt_s
from .ledger import check_cluster, clock_options, cluster_flags, global_batch, hardware

PLAN_EXAMPLES = """examples:
  fived plan --model llama3-70b --gpus 64 --gpus-per-node 8 --gpu h100-sxm --precision bf16 \\
             --seq-len 8192 --global-batch-tokens 4M
  fived plan --model llama2-7b --gpus 8 --gpu rtx-pro-6000 --precision bf16 \\
             --global-batch-tokens 1M --top 5
  fived plan --model mixtral-8x7b --gpus 32 --gpu h200 --global-batch-tokens 2M --json

How it decides: every layout (tp, cp, pp, v, dp, ep, ZeRO stage, micro-batch size, recompute)
that `fived.config.validate` accepts is costed by the ledger. A layout is discarded when its
largest rank needs more than --mem-fraction of the device, or when it breaks the iron rule
(tp and cp talk every layer, so tp·cp ranks must sit inside one node). The rest are ranked by
predicted step time = (micro-batches + bubble)·(compute + exposed tp/cp/ep/pp comm) + exposed
data-parallel comm + optimizer; MFU = model FLOPs · tokens/s / (GPUs · peak).
"""


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived plan", description="Search the layouts of a model on a cluster and rank "
        "those that fit by predicted step time.", epilog=PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_config_flags(ap, only=("model", "seq_len", "precision", "grad_reduce_dtype",
                                     "fp8", "fp8_gather", "global_batch"),
                           notes={"layout": "the search tries the degrees, ZeRO stages, schedules "
                                            "and recompute modes; these it keeps"})
    cluster_flags(ap)
    g = ap.add_argument_group("search space")
    g.add_argument("--top", type=int, default=10, metavar="N", help="layouts to print (default: 10)")
    g.add_argument("--schedules", default="1f1b,interleaved", metavar="LIST",
                   help=f"pipeline schedules to try, of {', '.join(SCHEDULES)} "
                        "(default: 1f1b,interleaved)")
    g.add_argument("--micro-batch-sizes", default="1,2,4,8", metavar="LIST",
                   help="sequences per micro-batch to try (default: 1,2,4,8)")
    g.add_argument("--recompute", dest="search_recompute", default="none,selective,full",
                   metavar="LIST",
                   help="recompute modes to try (default: none,selective,full)")
    g.add_argument("--zero", dest="search_zero", default="0,1,2,3", metavar="LIST",
                   help="ZeRO stages to try (default: 0,1,2,3)")
    g.add_argument("--max-virtual", type=int, default=4, metavar="N",
                   help="largest interleaving factor v (default: 4)")
    g.add_argument("--optimizers", dest="search_optimizers", default="", metavar="LIST",
                   help=f"optimizers to try, of {', '.join(OPTIMIZERS)} (their state bytes and "
                        "traffic; default: only --optimizer)")
    return ap


def _names(flag: str, text: str, allowed: tuple) -> tuple:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in out if x not in allowed]
    if bad or not out:
        raise ConfigError([f"{flag} {text!r}: give a comma list of {', '.join(map(str, allowed))}"])
    return out


def _ints(flag: str, text: str, least: int, most: int | None = None) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or any(x < least or (most is not None and x > most) for x in out):
        rng = f">= {least}" if most is None else f"in {least}..{most}"
        raise ConfigError([f"{flag} {text!r}: give a comma list of integers {rng}"])
    return out


def check_whole_nodes(gpus: int, gpn: int, gpn_given: bool) -> None:
    """A cluster of more than one node is whole nodes: --gpus a multiple of --gpus-per-node
    (the layouts place tp and cp inside a node), else a ConfigError saying so."""
    if gpus > gpn and gpus % gpn:
        whence = "--gpus-per-node" if gpn_given else "--gpus-per-node (the --gpu's default)"
        lo, hi = gpus // gpn * gpn, (gpus // gpn + 1) * gpn
        raise ConfigError([f"--gpus {gpus} is not a multiple of {whence} {gpn}: "
                           f"{gpus // gpn} full node(s) and {gpus % gpn} GPU(s) over; use "
                           f"--gpus {lo} or {hi}, or the --gpus-per-node of your nodes"])


def main(argv: list[str]) -> int:
    from dataclasses import replace

    args = parser().parse_args(argv)
    res = flags.configs(args)
    check_cluster(args)
    gpus = args.gpus if args.gpus is not None else DEFAULT_WORLD
    check_count("--gpus", gpus)
    check_count("--top", args.top)
    check_count("--max-virtual", args.max_virtual)
    space = _search_space(args)
    m = res.model
    # the training default (16 sequences) caps data parallelism at 16: on a cluster, plan for
    # a batch that grows with it (fived.ledger.planner.cluster_batch, the ledger's rule too)
    gb, batch_note = global_batch(args, res, gpus)
    train = replace(res.train, global_batch=gb)
    check_fixed(res)
    par, precision = resolve_precision(res.par, args.gpu != "this-machine", args.gpu)
    problems = check_values(m, par, train)
    if problems:
        raise ConfigError(problems)
    # the model and the run, on one rank: the search checks each layout itself
    fixed = fixed_fields(res)
    if not par.fp8_gather and par.fp8 == "none":  # the searched layouts would gather in bf16
        raise ConfigError(["--no-fp8-gather: turns off ZeRO's fp8 all-gather of the searched "
                           "layouts, but --fp8 is none; drop it, or add --fp8 tensorwise, "
                           "rowwise or blockwise"])
    validate(m, ParallelConfig(precision=par.precision, grad_reduce_dtype=par.grad_reduce_dtype,
                               **{k: v for k, v in fixed.items() if k != "fp8_gather"}), train)
    if args.print_config:
        return flags.print_config(replace(res, par=par, train=train),
                                  f"fived plan: {gpus} GPUs · {precision}; the [parallel] layout "
                                  "is searched")
    from ..ledger import params, planner

    args.window = m.seq_len  # --doc-len's documents are cut to it (clock_options)
    hw = hardware(args, gpus)
    gpn = args.gpus_per_node or hw.gpus_per_node
    check_whole_nodes(gpus, gpn, args.gpus_per_node is not None)  # issue 45 item 2
    gb = train.global_batch
    con = None
    if not args.json:
        con = report.console(args.wide)
        con.print(f"[bold]fived plan[/]: {precision} · {m.name} ({fmt_n(params.total_params(m))} "
                  f"params, seq {m.seq_len}) on {gpus}× {hw.name} ({gpn} per node) · global "
                  f"batch {gb} × {m.seq_len} = {fmt_n(gb * m.seq_len)} tokens{batch_note} · "
                  f"{par.grad_reduce_dtype} gradients · "
                  f"{', '.join(_optimizers(args, train))}"
                  + "".join(f" · {k} {flags.shown(v)}" for k, v in fixed.items()))
    with _search_bar() as bar:
        res_ = planner.plan(m, gpus, hw, gb, gpn, args.efficiency, args.mem_fraction,
                       clock=clock_options(args), precision=par.precision,
                       grad_reduce_dtype=par.grad_reduce_dtype,
                       optimizer=_optimizers(args, train), fixed=fixed, progress=bar,
                       top=args.top, **space)
    top = res_.ranked[:args.top]
    if args.json:
        doc = {"model": m.name, "seq_len": m.seq_len, "gpus": gpus, "gpus_per_node": gpn,
               "hardware": hw.as_dict(), "global_batch": gb, "global_batch_tokens": gb * m.seq_len,
               "precision": par.precision, "precision_note": precision,
               "global_batch_note": batch_note.strip(" ()"),
               "grad_reduce_dtype": par.grad_reduce_dtype,
               "optimizers": list(_optimizers(args, train)), "fixed": {
                   k: list(v) if isinstance(v, tuple) else v for k, v in fixed.items()},
               "efficiency": args.efficiency, "counts": res_.counts, "reasons": res_.reasons,
               "top": [p.as_dict() for p in top]}
        if not top and res_.smallest_unfit:
            doc["smallest_unfit"] = res_.smallest_unfit.as_dict()
        report.print_json(doc)
        return 0 if top else 1
    return _print_result(con, res_, top, args, replace(res, par=par), hw, gpus, gpn)


# [parallel] keys of a --config: the search tries these (the file's values are not used) ...
SEARCHED = ("tp", "cp", "ep", "dp", "pp", "zero", "schedule", "virtual_stages", "micro_batches",
            "sequence_parallel", "recompute", "pp_layers")
# ... keeps these as the file gives them, for every layout it tries ...
FIXED = ("cp_mode", "ep_dispatch", "bucket_mb", "overlap", "order", "fp8", "fp8_gather")
# ... and refuses the rest (the ledger of one layout, `fived ledger --config`, reads them)
REFUSED = ("zero3_pp_gather", "master_weights", "collectives", "zero_align")


def check_fixed(res: flags.Resolved) -> None:
    """A --config's [parallel] keys the search neither tries nor keeps: one error naming them."""
    bad = [k for k in REFUSED if f"parallel.{k}" in res.given]
    if bad:
        raise ConfigError([f"--config: [parallel] {', '.join(bad)}: fived plan does not search "
                           f"or use {'it' if len(bad) == 1 else 'them'}; remove "
                           f"{'it' if len(bad) == 1 else 'them'} (`fived ledger --config` "
                           "reads every key of one layout); the plan keeps "
                           f"{', '.join(FIXED)} as given and searches {', '.join(SEARCHED)}"])


def fixed_fields(res: flags.Resolved) -> dict:
    """The [parallel] values every searched layout keeps (cp_mode, ep_dispatch, bucket_mb,
    overlap, order, fp8 and its gather)."""
    return {k: getattr(res.par, k) for k in FIXED if f"parallel.{k}" in res.given}


def _search_space(args) -> dict:
    """The layout search's options, each checked against its flag."""
    return dict(
        schedules=_names("--schedules", args.schedules, SCHEDULES),
        micro_batch_sizes=_ints("--micro-batch-sizes", args.micro_batch_sizes, 1),
        recomputes=_names("--recompute", args.search_recompute, RECOMPUTE),
        zeros=_ints("--zero", args.search_zero, 0, 3), max_virtual=args.max_virtual)


def _optimizers(args, train) -> tuple[str, ...]:
    """``--optimizers LIST`` (the search), else the one ``--optimizer``."""
    return (_names("--optimizers", args.search_optimizers, OPTIMIZERS)
            if args.search_optimizers else (train.optimizer,))


@contextmanager
def _search_bar():
    """``progress(done, total)`` for the search, on stderr always: a bar that vanishes when
    done where stderr is a terminal; elsewhere (a pipe, a log, ``--json``) a line every few
    seconds and one at the end (``total`` None: the layouts are still being enumerated)."""
    import sys
    import time

    if not sys.stderr.isatty():
        start = time.monotonic()
        last = [start - 10.0]

        def line(done: int, total: int | None) -> None:
            now = time.monotonic()
            if now - last[0] < 2.0 and done != total:
                return
            last[0] = now
            what = (f"{done} layouts enumerated" if total is None else
                    f"{done}/{total} layouts costed ({done / max(total, 1):.0%})")
            print(f"fived plan: searching: {what}, {now - start:.0f} s", file=sys.stderr,
                  flush=True)
        yield line
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(TextColumn("searching layouts"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("search", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _print_result(con, res_, top, args, res, hw, gpus: int, gpn: int) -> int:
    """The counts, the top table, why the winner wins and its ledger command; 1 if none fits."""
    m, par = res.model, res.par
    c = res_.counts
    con.print(f"considered {c.get('evaluated', 0)} layouts: {c.get('fit', 0)} fit "
              f"({c.get('timed', 0)} timed in full: the rest are slower by a lower bound), "
              f"{c.get('out_of_memory', 0)} do not fit in {fmt_b(hw.memory * args.mem_fraction)}, "
              f"{c.get('invalid', 0)} invalid for the model, "
              f"{c.get('iron_rule', 0)} (tp, cp) pairs break the iron "
              f"rule (tp·cp > {gpn} GPUs per node)")
    if not top:
        s = res_.smallest_unfit
        con.print("[bold red]no layout fits[/]" + (
            f": the smallest needs {fmt_b(s.memory.peak)} ({s.name()})" if s else ""))
        return 1
    _print_top(con, top, args.wide)
    _print_time_split(con, top[:3])
    con.print("[bold]why the best one wins[/]")
    report.bullets(con, res_.reasons)
    con.print("run the ledger of the winner:")
    con.print(report.shell(f"fived ledger --model {m.name} --gpus {gpus} --gpu {args.gpu} "
              + (f"--gpus-per-node {gpn} " if args.gpus_per_node else "") + _flags(top[0])
              + (f" --seq-len {m.seq_len}" if "model.seq_len" in res.given else "")
              + (f" --precision {par.precision}" if "parallel.precision" in res.given else "")
              + (f" --grad-reduce-dtype {par.grad_reduce_dtype}"
                 if par.grad_reduce_dtype != "fp32" else "")
              + (f" --optimizer {top[0].optimizer}" if top[0].optimizer != "adamw" else "")),
              soft_wrap=True, markup=False)  # 80 columns, continued with \ (issue 45)
    return 0


def _print_top(con, top, wide: bool) -> None:
    """The table of the best layouts (80 columns; more with ``--wide``) and its legend."""
    cols = [("#", "r"), ("layout", "l"), ("peak/rank", "r")]
    if wide:
        cols += [("m", "r"), ("bubble", "r"), ("tp", "r"), ("cp", "r"), ("ep", "r"), ("pp", "r"),
                 ("dense", "r")]
    cols += [("step", "r")] + ([("tokens/s", "r")] if wide else []) + [("MFU", "r")]
    t = report.table(f"top {len(top)} layouts by predicted step time", cols, wrap=("layout",))
    for i, p in enumerate(top, 1):
        row = [str(i), p.name(), fmt_b(p.memory.peak)]
        if wide:
            tr = p.traffic
            row += [str(p.par.micro_batches), f"{p.bubble:.1%}",
                    *(fmt_b(tr.get(g, 0)) if tr.get(g) else "-"
                      for g in ("tp", "cp", "ep", "pp", "dense"))]
        row += [fmt_s(p.step_seconds)] + ([fmt_n(p.tokens_per_s)] if wide else [])
        row.append(f"{p.mfu:.1%}")
        t.add_row(*row)
    report.show(con, t)
    if wide:
        con.print("[dim]m: micro-batches; traffic columns: bytes one rank sends per step on each "
                  "group (slowest pipeline rank); mem/rank: the largest rank[/]")
    else:
        con.print("[dim]layout: degrees, v (interleaving), ZeRO stage, sp, b (sequences per "
                  "micro-batch), rc (recompute); mem/rank: the largest rank. --wide: "
                  "micro-batches, bubble, traffic per group, tokens/s; --json: all of it[/]")


SPLIT = (("compute", ("compute",)), ("membw", ("memory_bound",)), ("recomp", ("recompute",)),
         ("tp", ("tp",)), ("cp", ("cp",)), ("ep", ("ep",)), ("pp", ("pp_p2p",)),
         ("dp", ("dp", "zero_per_micro")), ("bubble", ("bubble",)), ("opt", ("optimizer",)))


def _print_time_split(con, top) -> None:
    """Where each of the best layouts' step goes (the roofline clock's components)."""
    t = report.table("where the time goes (share of the step; exposed communication only)",
                     [("#", "r")] + [(name, "r") for name, _ in SPLIT])
    for i, p in enumerate(top, 1):
        t.add_row(str(i), *(_share(p, keys) for _, keys in SPLIT))
    report.show(con, t)
    con.print("[dim]compute: matmuls and attention; membw: memory-bound ops (norms, RoPE, "
              "activations, loss); tp..dp: communication not hidden behind compute; opt: the "
              "optimizer step (docs/ledger.md)[/]")


def _share(p, keys) -> str:
    v = sum(p.times.get(k, 0.0) for k in keys)
    return f"{v / p.step_seconds:.0%}" if v > 0 else "-"


def _flags(p) -> str:
    par = p.par
    out = [f"--{d} {par.degree(d)}" for d in ("tp", "cp", "ep", "pp", "dp") if par.degree(d) > 1]
    if par.hybrid:
        out.append(f"--dp-shard {par.shard_degree}")
    if par.zero:
        out.append(f"--zero {par.zero}")
    if par.pp > 1 and par.schedule != "1f1b":
        out.append(f"--schedule {par.schedule}")
    if par.virtual_stages > 1:
        out.append(f"--virtual-stages {par.virtual_stages}")
    if par.pp_layers:
        out.append("--pp-layers " + ",".join(map(str, par.pp_layers)))
    if par.sequence_parallel:
        out.append("--sequence-parallel")
    if par.recompute != "none":
        out.append(f"--recompute {par.recompute}")
    if par.cp_mode != "ring":
        out.append(f"--cp-mode {par.cp_mode}")
    if par.ep > 1 and par.ep_dispatch != "rows":
        out.append(f"--ep-dispatch {par.ep_dispatch}")
    if par.bucket_mb != ParallelConfig.bucket_mb:
        out.append(f"--bucket-mb {par.bucket_mb:g}")
    if not par.overlap:
        out.append("--no-overlap")
    if par.order != DIMS:
        out.append("--order " + ",".join(par.order))
    if par.fp8 != "none":
        out.append(f"--fp8 {par.fp8}")
    if not par.fp8_gather:
        out.append("--no-fp8-gather")
    out.append(f"--micro-batches {par.micro_batches} --global-batch {p.global_batch}")
    return " ".join(out)
