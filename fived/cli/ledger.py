"""``fived ledger``: every byte of one layout — memory, FLOPs, traffic and time.

The layout comes from the shared flags (or ``--config``), exactly as ``fived train`` reads
them: the same defaults, the same "dp takes the ranks left over" rule (of ``--gpus`` here), the
same ``validate``. Nothing here needs a GPU, a process group or torch: the numbers come from
``fived.ledger``'s formulas and a hardware preset.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    check_count,
    fill_dp,
    resolve_precision,
    validate,
)
from ..ui import flags, report
from ..ui.args import Parser
from ..ui.ledger_view import advice, ledger_document
from ..ui.report import fmt_b, fmt_n, fmt_s, parse_count

LEDGER_EXAMPLES = """examples:
  fived ledger --model llama2-7b --gpus 8 --gpu rtx-pro-6000 --precision bf16 --zero 3
  fived ledger --model llama3-70b --gpus 64 --gpu h100-sxm --tp 8 --pp 4 --sequence-parallel \\
               --zero 1 --precision bf16 --micro-batches 64 --global-batch-tokens 4M
  fived ledger --model tiny --gpus 2 --global-batch 8 --json
  fived ledger --config run.toml             # the ledger of what `fived train --config` runs
  fived ledger --check m.jsonl               # against `fived train --metrics-out m.jsonl`

What it shows: the parameter count and the two headline numbers (bf16 weights are 2Ψ bytes,
mixed-precision Adam training state 16Ψ), then for this layout every term of the largest rank's
memory (model states by ZeRO stage, activations with the pipeline in-flight factor, buffers),
FLOPs per token (attention not causal-halved), every collective each dimension runs per step
with its bytes (the runtime's Traffic units) and alpha-beta time, and the predicted step time,
bubble, tokens/s and MFU. --dp defaults to what the other degrees leave of --gpus, and --gpus
to what `fived train` would start (4 ranks, or the product of the degrees).
"""


# ------------------------------------------------------------------------ shared with plan
def cluster_flags(ap: argparse.ArgumentParser) -> None:
    """The cluster, the time model's assumptions and the output: ``fived ledger``/``plan``."""
    from ..ledger import hardware

    g = ap.add_argument_group("cluster", "the machines the layout would run on")
    g.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="devices in the cluster (default: what `fived train` would start: 4, "
                        "or the product of the degrees given)")
    g.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="devices per node (default: the hardware preset's, 8)")
    g.add_argument("--gpu", default="h100-sxm", metavar="NAME",
                   help=f"hardware preset: {', '.join(hardware.PRESETS)}, or this-machine "
                        "(measured matmul + --bench-json) (default: h100-sxm)")
    g.add_argument("--bench-json", default=None, metavar="FILE",
                   help="this-machine: `fived bench comm --json` output to fit the link from")
    g.add_argument("--global-batch-tokens", default=None, metavar="N",
                   help="tokens per optimizer step, e.g. 4M (= 4·2^20): sets --global-batch to "
                        "tokens / seq_len (default: use --global-batch)")
    g = ap.add_argument_group("assumptions of the time model")
    g.add_argument("--efficiency", type=float, default=None, metavar="X",
                   help="the old flat clock: every matmul at this fraction of peak (default: "
                        "the roofline clock, each op at its shape; docs/ledger.md)")
    g.add_argument("--tp-overlap", action="store_true",
                   help="TP collectives run under the matmuls (Megatron's --tp-comm-overlap)")
    g.add_argument("--mem-fraction", type=float, default=0.9, metavar="X",
                   help="fraction of device memory a layout may use (default: 0.9)")
    g.add_argument("--attention", default="flash", choices=["flash", "materialised"],
                   help="attention kernel: flash (saves log-sum-exp) or materialised scores "
                        "(default: flash)")
    g.add_argument("--doc-len", default=None, metavar="N|DIR",
                   help="document masks (--doc-mask): attention FLOPs follow the documents, "
                        "Σ Lᵢ²/S per token instead of S — N: the mean document length in "
                        "tokens; DIR: a prepared data directory (its training documents' "
                        "lengths); the memory counts what the masks save (default: no mask)")
    g = ap.add_argument_group("output")
    g.add_argument("--wide", action="store_true",
                   help="every column (the default tables fit 80 columns)")
    g.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def check_cluster(args: argparse.Namespace) -> None:
    problems = []
    for flag, v in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node)):
        if v is not None:
            try:
                check_count(flag, v)
            except ConfigError as e:
                problems += e.problems
    for flag, v in (("--efficiency", args.efficiency), ("--mem-fraction", args.mem_fraction)):
        if v is not None and not 0 < v <= 1:
            problems.append(f"{flag} must be in (0, 1] (got {v:g})")
    if problems:
        raise ConfigError(problems)


def hardware(args: argparse.Namespace, ranks: int = 1, par=None, model=None,
             micro_batch: int = 0):
    """The preset, or for ``this-machine`` a measured one (``fived.probe.machine``; with a
    layout, its kernels timed as they will run)."""
    from ..ledger import hardware

    if args.gpu == "this-machine":
        from ..probe.machine import this_machine

        return this_machine(args.bench_json, ranks=ranks, par=par, model=model,
                            micro_batch=micro_batch, clock=clock_options(args))
    return hardware.get(args.gpu, args.bench_json)


def clock_options(args: argparse.Namespace):
    from ..ledger.roofline import ClockOptions

    eager = args.gpu == "this-machine"  # the fived runtime's attention: scores in memory
    return ClockOptions(attention="materialised" if eager or args.attention == "materialised"
                        else "flash", tp_overlap=args.tp_overlap, fused=not eager,
                        comm_overlap=not eager, attn_context=doc_context_of(args))


def doc_context_of(args: argparse.Namespace) -> float:
    """``--doc-len``: the attended keys per token (``compute.doc_context``); 0 without it."""
    spec = getattr(args, "doc_len", None)
    if not spec:
        return 0.0
    from ..ledger.compute import doc_context

    seq = getattr(args, "window", 0)
    try:
        mean = float(spec)
    except ValueError:
        mean = None
    if mean is not None:
        if not mean > 0:
            raise ConfigError([f"--doc-len {spec}: give a mean document length > 0 or a "
                               "prepared data directory"])
        return doc_context(seq, mean=mean)
    from pathlib import Path

    import numpy as np

    from ..data.meta import read_meta

    meta = read_meta(spec, "--doc-len")
    idx = np.load(Path(spec) / meta["splits"]["train"]["index"])
    return doc_context(seq, lengths=np.diff(idx).tolist())


def global_batch(args: argparse.Namespace, res: flags.Resolved, gpus: int | None = None,
                 multiple: int = 1, seq_len: int | None = None) -> tuple[int, str]:
    """(sequences per step, how they were chosen): --global-batch (or the TOML's) unless
    --global-batch-tokens is given without --global-batch on the command line; with neither,
    ``fived.ledger.planner.cluster_batch`` of ``gpus`` (None: the training default, 16)."""
    from ..ledger.planner import cluster_batch

    if not args.global_batch_tokens and "train.global_batch" not in res.given:
        gb = res.train.global_batch
        if gpus is None:
            return gb, ""
        auto = cluster_batch(gpus, gb, multiple, seq_len)
        if auto == gb:
            return gb, ""
        rule = (f"about 4M tokens (4·2^20) or {gpus} GPUs / 4 sequences, the larger, as a "
                "power of two" if seq_len else f"{gpus} GPUs / 4 as a power of two")
        return auto, (f" (no --global-batch: {rule}, at least {gb}"
                      + (f", a multiple of {multiple}" if multiple > 1 else "") + ")")
    return _given_batch(args, res), ""


def _given_batch(args: argparse.Namespace, res: flags.Resolved) -> int:
    if args.global_batch_tokens and args.global_batch is None:
        try:
            tokens = parse_count(args.global_batch_tokens)
        except ValueError:
            raise ConfigError([f"--global-batch-tokens {args.global_batch_tokens!r}: give a count "
                               "like 4M, 512K or 1048576"]) from None
        m = res.model
        if tokens < m.seq_len or tokens % m.seq_len:
            raise ConfigError([f"--global-batch-tokens {args.global_batch_tokens} = {tokens} is "
                               f"not a positive multiple of seq_len {m.seq_len}"])
        return tokens // m.seq_len
    return res.train.global_batch


# ------------------------------------------------------------------------ fived ledger
def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived ledger", description="The full memory / FLOPs / traffic / time breakdown "
        "of one layout.", epilog=LEDGER_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_config_flags(ap, skip=("doc_len",), notes={  # --doc-len: the ledger's own
        "run": "the ledger uses --global-batch; the rest are taken so that a `fived train` "
               "command line (or --config) gives the ledger of that run"})
    cluster_flags(ap)
    g = ap.add_argument_group("ledger")
    g.add_argument("--eager-activations", action="store_true",
                   help="activations as the fived runtime's eager PyTorch saves them (K/V "
                        "repeated to the heads, fp32 RMSNorm intermediates); default: fused "
                        "GPU kernels (flash attention, fused RMSNorm)")
    g.add_argument("--check", default=None, metavar="METRICS_JSONL",
                   help="compare the ledger with a `fived train --metrics-out` file, exactly; "
                        "exit 1 on any byte of difference. The file's first line records the "
                        "run (model, layout, precision, global batch), which is then used and "
                        "the layout flags are ignored; for a file without it, give the run's "
                        "flags (the defaults are `fived train`'s)")
    g.add_argument("--validate", action="store_true",
                   help="the clock against published runs (fived/ledger/runs.toml): MFU "
                        "predicted vs published, throughput ratio, the median and worst error")
    g.add_argument("--refit", action="store_true",
                   help="with --validate: rerun the grid search of the clock's global "
                        "constants and show the best (the presets keep theirs)")
    g.add_argument("--plot", default=None, metavar="PNG",
                   help="with --validate: write the predicted-vs-published MFU figure")
    g.add_argument("--train-tokens", default="1T", metavar="N",
                   help="token budget for the time wall, decimal (default: 1T = 1e12)")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.validate:
        from .validate import main as validate_main

        return validate_main(args)
    res = flags.configs(args)
    if res.train.data:  # the run's vocabulary is its tokenizer's, padded (fived.data.meta)
        from ..data.meta import model_for_data

        res = replace(res, model=model_for_data(res.model, res.train.data,
                                                "model.vocab" in res.given))
    check_cluster(args)
    if args.check and not args.print_config:
        from ..ledger.verify import run_of_file

        try:
            run = run_of_file(args.check)
        except (OSError, ValueError) as e:
            raise ConfigError([f"--check {args.check}: cannot read it ({e})"]) from None
        if run is not None:  # the file says what ran: its layout, not the flags
            return _check(*run, args.check, args.json, from_file=True)
    m = res.model
    par, world = fill_dp(res.par, res.dp_given, args.gpus)
    par, precision = ledger_precision(args, par)
    # a cluster (--gpus on a GPU preset): what the flags leave out is what a GPU run would
    # pick — for a billion parameters or more a batch of about 4M tokens — and one sequence
    # per micro-batch (m >= pp)
    cluster = args.gpus is not None and not args.check and args.gpu != "this-machine"
    auto_m = cluster and "parallel.micro_batches" not in res.given and par.world_size >= 1
    replicas = par.dp * par.ep
    multiple = (replicas * par.pp if auto_m else replicas * par.micro_batches
                ) if par.world_size >= 1 else 1
    gb, batch_note = global_batch(args, res, world if args.gpus is not None and not args.check
                                  else None, max(multiple, 1),
                                  seq_len=m.seq_len if cluster and _large(m) else None)
    if auto_m and gb % replicas == 0:
        par = _auto_micro_batches(m, par, gb)
    train = replace(res.train, global_batch=gb)
    validate(m, par, train, world)
    args.window = m.seq_len  # --doc-len's documents are cut to it (clock_options)
    if args.print_config:
        return flags.print_config(replace(res, par=par, train=train),
                                  f"fived ledger: {world} GPUs · {precision}")
    if args.check:
        return _check(m, par, gb, args.check, args.json)
    try:
        train_tokens = parse_count(args.train_tokens, binary=False)
    except ValueError:
        raise ConfigError([f"--train-tokens {args.train_tokens!r}: give a count like 1T or 2e12"]
                          ) from None
    if args.gpu == "this-machine":
        import sys

        from ..ledger.traffic import micro_batch_size

        print(f"fived ledger: measuring this machine on {world} rank(s) ...", flush=True,
              file=sys.stderr)
        hw = hardware(args, world, par, m, micro_batch_size(par, gb))
    else:
        hw = hardware(args, world)
    gpn = args.gpus_per_node or hw.gpus_per_node
    from ..ledger import memory as memory_ledger

    masked = bool(getattr(args, "doc_len", None))  # --doc-len: the masks' saved bytes too
    if args.eager_activations or args.gpu == "this-machine":  # the fived runtime's kernels
        opts = memory_ledger.ActivationOptions("materialised" if args.gpu == "this-machine" else
                                   args.attention, doc_mask=masked)
    else:
        opts = memory_ledger.ActivationOptions(args.attention, kv_repeat=False, fused_norm=True,
                                               doc_mask=masked)
    doc = ledger_document(m, par, hw, gb, gpn, args.efficiency, args.mem_fraction, opts,
                          train_tokens, train.optimizer, clock_options(args))
    doc["precision_note"] = precision
    doc["global_batch_note"] = batch_note.strip(" ()")
    doc["advice"] = advice(doc, args, res, par, world, gb, batch_note, auto_m)
    if args.json:
        report.print_json(doc)
        return 0
    print_ledger(doc, m, par, hw, args.wide, precision,
                 " (assumed: see the end)" if batch_note else "")
    print_advice(doc["advice"])
    return 0


def _large(m: ModelConfig) -> bool:
    """A billion parameters or more: the models GPU runs give a batch of millions of tokens."""
    from ..ledger.params import total_params

    return total_params(m) >= 1e9


def _auto_micro_batches(m: ModelConfig, par: ParallelConfig, gb: int) -> ParallelConfig:
    """One sequence per micro-batch (the rest accumulated), as a GPU run of a large model
    does; kept at the default where the layout refuses it."""
    auto = replace(par, micro_batches=gb // (par.dp * par.ep))
    try:
        validate(m, auto)
    except ConfigError:
        return par
    return auto


def print_advice(adv: dict) -> None:
    """The assumptions and what to change, last (what a terminal shows above the prompt)."""
    if not (adv["assumed"] or adv["change"]):
        return
    con = report.console()
    if adv["assumed"]:
        con.print("[bold]assumed[/] (no flag gave these):")
        report.bullets(con, adv["assumed"])
    if adv["change"]:
        con.print("[bold yellow]what to change[/]:")
        report.bullets(con, adv["change"])
    if adv["plan"]:
        con.print("to search every layout for one that fits and is fastest:")
        con.print(f"  {adv['plan']}", soft_wrap=True, markup=False, highlight=False)


def ledger_precision(args: argparse.Namespace, par: ParallelConfig) -> tuple[ParallelConfig, str]:
    """``--precision auto`` for the ledger (``fived.config.resolve_precision``): bf16 on a GPU
    preset, fp32 on --gpu this-machine; with --check (a `fived train` run's file), what
    `fived train` resolves here (bf16 on a cuda device, else fp32)."""
    if args.check:
        from ..ranks.launch import cuda_expected

        gpu = cuda_expected()
        return resolve_precision(par, gpu, "fived train on " + ("cuda" if gpu else "the cpu"))
    return resolve_precision(par, args.gpu != "this-machine", args.gpu)


def _check(m: ModelConfig, par: ParallelConfig, gb: int, path: str, as_json: bool,
           from_file: bool = False) -> int:
    from ..ledger.verify import compare_file

    source = "recorded in the file" if from_file else "from the flags"

    bad = compare_file(m, par, gb, path)
    rows, peak_bad = _peaks(m, par, gb, path)
    if as_json:
        report.print_json({"metrics": path, "layout": par.describe(), "layout_source": source,
                           "exact": not bad, "mismatches": bad, "peak": rows,
                           "peak_mismatches": peak_bad,
                           "peak_skipped": "" if rows else PEAK_SKIPPED})
    else:
        con = report.console()
        if bad:
            con.print(f"[bold red]{len(bad)} mismatch(es)[/] between the ledger and {path}:")
            for line in bad:
                con.print(f"  {line}", markup=False, highlight=False)  # keep "memory[master]"
            con.print(f"(the ledger assumed {par.describe()}, --precision {par.precision}, "
                      f"--global-batch {gb}, --recompute {par.recompute}, {source}"
                      + ("" if from_file else ": give the run's own") + ")",
                      markup=False, highlight=False)
        else:
            con.print(f"[green]exact[/]: every rank's model-state bytes and traffic bytes in "
                      f"{path} equal the ledger's ({m.name}, {par.describe()}, "
                      f"{par.precision}, global batch {gb}; layout {source})")
        _dry_run_activations(m, par, gb, path)
        _print_peaks(rows, peak_bad)
    return 1 if bad or peak_bad else 0


PEAK_SKIPPED = ("this file holds no traced peak (a run without --memory-trace, or recorded "
                "before the trace existed): the step peak is not compared")


def _peaks(m: ModelConfig, par: ParallelConfig, gb: int, path: str
           ) -> tuple[list[dict], list[str]]:
    """The traced step peaks of the file's last record against the ledger's."""
    import json

    from ..ledger.verify import check_peak, peak_rows

    with open(path) as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        return [], []
    run = json.loads(lines[0]).get("run") or {}
    rows = peak_rows(m, par, gb, json.loads(lines[-1]), run.get("optimizer", "adamw"),
                     bool(run.get("doc_mask", False)))
    return rows, check_peak(rows)


def _print_peaks(rows: list[dict], bad: list[str]) -> None:
    from ..ledger.verify import PEAK_TOLERANCE

    con = report.console()
    if not rows:
        con.print(PEAK_SKIPPED, markup=False, highlight=False)
        return
    for line in bad:
        con.print(f"  {line}", markup=False, highlight=False)
    t = report.table(f"step peak per rank: ledger vs traced (target {PEAK_TOLERANCE:.1%})",
                     [("rank", "r"), ("ledger", "r"), ("measured", "r"), ("diff", "r"),
                      ("ledger's phase", "l")], wrap=("ledger's phase",))
    for r in rows:
        t.add_row(str(r["rank"]), report.fmt_b(r["ledger"]), report.fmt_b(r["measured"]),
                  f"{r['diff']:+.2%}", f"{r['ledger_phase']} ({r['transient'] or '-'})")
    report.show(con, t)


def _dry_run_activations(m: ModelConfig, par: ParallelConfig, gb: int, path: str) -> None:
    """A dry run's file (``fived train --dry-run``): its ranks' activation peaks by the ledger's."""
    import json

    from ..ledger.verify import activation_check_skipped, predict_activations

    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rec = json.loads(lines[-1]) if lines else {}
    if "activation_peak_per_rank" not in rec:
        return
    skipped = activation_check_skipped(par)
    rows = []
    for r, got in zip(rec["ranks"], rec["activation_peak_per_rank"]):
        pred = predict_activations(m, par, gb, r, bool((rec.get("run") or {}).get("doc_mask")))
        rows.append([str(r), report.fmt_b(pred), report.fmt_b(got),
                     f"{(got - pred) / max(pred, 1):+.2%}"])
    title = ("dry run: activation peak per rank (not compared: " + skipped + ")" if skipped else
             "dry run: activation peak per rank (compared within 0.5 % or 16 KiB)")
    t = report.table(title, [("rank", "r"), ("ledger", "r"), ("measured", "r"), ("diff", "r")])
    for row in rows:
        t.add_row(*row)
    report.show(report.console(), t)


def phase_name(name: str) -> str:
    """``B 3 1`` -> ``backward of micro-batch 3, stage 1`` (the ledger's phase names)."""
    kind, _, rest = name.partition(" ")
    words = {"F": "forward", "B": "backward", "W": "weight gradient"}
    if kind in words and rest:
        mb, _, st = rest.partition(" ")
        return f"{words[kind]} of micro-batch {mb}, stage {st}"
    return name or "-"


def print_ledger(doc: dict, m: ModelConfig, par: ParallelConfig, hw, wide: bool = False,
                 precision: str = "", batch_note: str = "") -> None:
    con = report.console(wide)
    md = doc["model"]
    n = md["params"]
    con.print(f"[bold]fived ledger[/]: {precision or par.precision} · {m.name} · "
              f"{doc['layout_name']} · {doc['world']}× {hw.name} · global batch "
              f"{doc['global_batch']} × {m.seq_len} tokens{batch_note}", markup=True,
              highlight=False)
    t = report.table("the model and the two walls",
                     [("quantity", "l"), ("value", "r"), ("how", "l")], wrap=("quantity", "how"))
    t.add_row("parameters Ψ", f"{n:,}", f"dense {md['dense']:,}, expert {md['expert']:,}, "
              f"active/token {md['active']:,}")
    t.add_row("weights in bf16", fmt_b(md["checkpoint_bf16_bytes"]), "2Ψ")
    verdict = "fits" if md["training_state_fits_one_device"] else "more than"
    t.add_row("training state, mixed-precision Adam", fmt_b(md["training_state_16psi_bytes"]),
              f"16Ψ = 2 + 2 + 4 + 8 bytes/param — {verdict} one {fmt_b(hw.memory)} {hw.name}")
    gdt = par.grad_reduce_dtype if par.precision != "fp32" else "fp32"
    t.add_row("this layout's model states", fmt_b(md["layout_training_state_bytes"]),
              f"{md['layout_bytes_per_param']}Ψ ({par.precision}, {gdt} grads), before sharding")
    cw = doc["compute"]["time_wall"]
    t.add_row(f"time wall, {fmt_n(cw['tokens'])} tokens", f"{cw['flops_6psid']:.2e} FLOPs",
              f"6ΨD; {fmt_s(cw['one_device_at_peak_seconds'])} on one device at peak, "
              f"{fmt_s(cw['seconds_at_predicted_mfu'])} on {doc['world']} at the predicted MFU")
    report.show(con, t)

    cols = [("pp rank", "r"), ("layers", "r"), ("dense", "r"), ("expert", "r"), ("total", "r")]
    if wide:
        cols += [("embed", "r"), ("head", "r")]
    t = report.table("parameters per pipeline rank (any tp/cp/ep/dp coordinate)", cols)
    num = (lambda x: f"{x:,}") if wide else fmt_n
    for r in doc["params_per_pp_rank"]:
        bd = r["breakdown"]
        row = [str(r["pp_rank"]), str(r["layers"]), num(r["dense"]), num(r["expert"]),
               num(r["total"])]
        if wide:
            row += [num(bd.get("embed", 0)), num(bd.get("head", 0))]
        t.add_row(*row)
    report.show(con, t)

    mem = doc["memory"]
    t = report.table(f"memory of the largest rank (pp rank {mem['pp_rank']}; in-flight "
                     f"micro-batches {mem['inflight_microbatches']:.2f})",
                     [("part", "l"), ("term", "l"), ("bytes", "r")], wrap=("term",))
    for k, v in mem["states"].items():
        t.add_row("model states", k, fmt_b(v))
    for k, v in mem["activations"].items():
        t.add_row("activations", k, fmt_b(v))
    t.add_row("[bold]kept[/]", "states + saved", f"[bold]{fmt_b(mem['kept'])}[/]")
    for k, v in mem["peak_transients"].items():
        t.add_row("transient", k, fmt_b(v))
    t.add_row("[bold]peak (step)[/]", f"in {phase_name(mem['peak_phase'])}",
              f"[bold]{fmt_b(mem['peak'])}[/]")
    ok = "[green]fits[/]" if doc["fits"] else "[bold red]does not fit[/]"
    t.add_row("device", f"{hw.name} usable", f"{fmt_b(doc['usable_memory'])} — {ok}")
    report.show(con, t)

    c = doc["compute"]
    t = report.table(f"compute ({c['convention']})", [("quantity", "l"), ("FLOPs", "r")],
                     wrap=("quantity",))
    t.add_row("forward per token", f"{c['forward_per_token']:.3e}")
    t.add_row("  of which attention (4·L·s·h_attn)", f"{c['attention_forward_per_token']:.3e}")
    t.add_row("backward per token (2× forward)", f"{c['backward_per_token']:.3e}")
    t.add_row("model FLOPs per token", f"{c['model_per_token']:.3e}")
    t.add_row(f"recompute per token ({par.recompute}; not model FLOPs)",
              f"{c['recompute_per_token']:.3e}")
    t.add_row("model FLOPs per step", f"{c['model_per_step']:.3e}")
    t.add_row("per rank per step", f"{c['per_rank_per_step']:.3e}")
    report.show(con, t)

    tr = doc["traffic"]
    cols = [("group", "l"), ("op", "l"), ("what", "l")]
    if wide:
        cols += [("S", "r"), ("n", "r"), ("calls", "r")]
    cols += [("bytes", "r")] + ([("link", "l")] if wide else []) + [("time", "r")]
    t = report.table(f"traffic per step, pipeline rank {tr['pp_rank']} (bytes this rank sends)",
                     cols, wrap=("what",))
    for x in tr["collectives"]:
        row = [x["group"], x["op"], x["what"]]
        if wide:
            row += [fmt_b(x["size"]), str(x["n"]), str(x["count"])]
        row += [fmt_b(x["bytes"])] + ([x["link"]] if wide else []) + [fmt_s(x["seconds"])]
        t.add_row(*row)
    for g, v in tr["bytes_by_group"].items():
        row = [f"[bold]{g}[/]", "", "total"] + ([""] * 3 if wide else [])
        row += [f"[bold]{fmt_b(v)}[/]"] + ([""] if wide else []) + [""]
        t.add_row(*row)
    report.show(con, t)

    tm = doc["time"]
    how = (f"flat: {tm['efficiency']:.0%} of peak in matmuls" if tm["efficiency"] else
           "this machine: the runtime's kernels timed at their shapes" if hw.eager else
           "roofline clock: each op at its shape")
    t = report.table(f"time per step ({how})",
                     [("component", "l"), ("seconds", "r"), ("share", "r")])
    for k, v in tm["components"].items():
        if v:
            t.add_row(k, fmt_s(v), f"{v / tm['step_seconds']:.1%}")
    t.add_row("[bold]step[/]", f"[bold]{fmt_s(tm['step_seconds'])}[/]", "")
    t.add_row("bubble fraction", f"{tm['bubble_fraction']:.2%}", "")
    t.add_row("tokens/s", fmt_n(tm["tokens_per_s"]), "")
    t.add_row("MFU", f"{tm['mfu']:.1%}", "" if doc["fits"] else "if it fit")
    report.show(con, t)
    if not wide:
        con.print("[dim]--wide: exact parameter counts and every traffic column; --json: all "
                  "of it[/]")
