"""``fived plan`` (search layouts) and ``fived ledger`` (every byte of one layout).

Both print rich tables, or one JSON document with ``--json``. Nothing here needs a GPU, a
process group or torch: the numbers come from ``fived.ledger``'s formulas and a hardware preset.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..config import DIMS, ConfigError, ModelConfig, ParallelConfig, preset, validate
from . import bubble as B
from . import compute as C
from . import hardware as H
from . import memory as M
from . import params as P
from . import planner as PL
from .traffic import micro_batch_size

_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SUFFIX10 = {"K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12}


def parse_count(text: str, binary: bool = True) -> int:
    """'4M' -> 4·2^20 (binary, for batch sizes) or 4e6 (decimal, for token budgets); '1e12'."""
    t = str(text).strip().upper()
    table = _SUFFIX if binary else _SUFFIX10
    if t and t[-1] in table:
        return int(float(t[:-1]) * table[t[-1]])
    return int(float(t))


def fmt_b(n: float) -> str:
    return M.fmt_bytes(n)


def fmt_n(n: float) -> str:
    for div, s in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{s}"
    return f"{n:.0f}"


def fmt_s(s: float) -> str:
    if s >= 86400 * 365:
        return f"{s / (86400 * 365):.2f} years"
    if s >= 86400:
        return f"{s / 86400:.1f} days"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


# ------------------------------------------------------------------------ shared flags
def _common(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model and cluster")
    g.add_argument("--model", default="llama2-7b",
                   help="preset: tiny, small, llama2-7b, llama3-8b, llama3-70b, llama3-405b, "
                        "mixtral-8x7b (default llama2-7b)")
    g.add_argument("--seq-len", type=int, default=None, help="override the model's seq_len")
    g.add_argument("--gpus", type=int, default=8, help="devices in the cluster (default 8)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per node (default: the preset's, 8)")
    g.add_argument("--gpu", default="h100-sxm",
                   help=f"hardware preset: {', '.join(H.PRESETS)}, or this-machine "
                        "(measured matmul + --bench-json)")
    g.add_argument("--bench-json", default=None,
                   help="this-machine: `fived bench comm --json` output to fit the link from")
    g.add_argument("--global-batch-tokens", default=None,
                   help="tokens per optimizer step, e.g. 4M (= 4·2^20); sets the global batch "
                        "in sequences as tokens / seq_len")
    g.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step")
    g.add_argument("--precision", default="bf16", help="fp32 | bf16 | fp16 (default bf16)")
    g.add_argument("--grad-reduce-dtype", default="fp32",
                   help="gradient buffer/reduction dtype: fp32 (18Ψ, default) or bf16 (16Ψ)")
    g = ap.add_argument_group("assumptions of the time model")
    g.add_argument("--efficiency", type=float, default=0.7,
                   help="sustained fraction of peak FLOP/s in the matmuls (default 0.7)")
    g.add_argument("--mem-fraction", type=float, default=0.9,
                   help="fraction of device memory a layout may use (default 0.9)")
    g.add_argument("--attention", default="flash", choices=["flash", "materialised"],
                   help="attention kernel: flash (saves log-sum-exp) or materialised scores")
    g.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def _model(args) -> ModelConfig:
    m = preset(args.model)
    if args.seq_len:
        m = replace(m, seq_len=args.seq_len)
    return m


def _hardware(args) -> H.Hardware:
    return H.get(args.gpu, args.bench_json)


def _global_batch(args, m: ModelConfig, default: int) -> int:
    if args.global_batch:
        return args.global_batch
    if args.global_batch_tokens:
        tokens = parse_count(args.global_batch_tokens)
        if tokens % m.seq_len:
            raise ConfigError([f"--global-batch-tokens {args.global_batch_tokens} = {tokens} is "
                               f"not a multiple of seq_len {m.seq_len}"])
        return tokens // m.seq_len
    return default


def _console():
    from rich.console import Console

    return Console()


# ------------------------------------------------------------------------ fived plan
PLAN_EXAMPLES = """examples:
  fived plan --model llama3-70b --gpus 64 --gpus-per-node 8 --gpu h100-sxm \\
             --seq-len 8192 --global-batch-tokens 4M
  fived plan --model llama2-7b --gpus 8 --gpu rtx-pro-6000 --global-batch-tokens 1M --top 5
  fived plan --model mixtral-8x7b --gpus 32 --gpu h200 --global-batch-tokens 2M --json

How it decides: every layout (tp, cp, pp, v, dp, ep, ZeRO stage, micro-batch size, recompute)
that `fived.config.validate` accepts is costed by the ledger. A layout is discarded when its
largest rank needs more than --mem-fraction of the device, or when it breaks the iron rule
(tp and cp talk every layer, so tp·cp ranks must sit inside one node). The rest are ranked by
predicted step time = (micro-batches + bubble)·(compute + exposed tp/cp/ep/pp comm) + exposed
data-parallel comm + optimizer; MFU = model FLOPs · tokens/s / (GPUs · peak).
"""


def main_plan(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="fived plan", description="Search the layouts of a model on a cluster and rank "
        "those that fit by predicted step time.", epilog=PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(ap)
    g = ap.add_argument_group("search space")
    g.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    g.add_argument("--schedules", default="1f1b,interleaved",
                   help="pipeline schedules to try (1f1b, interleaved, zb-h1, gpipe)")
    g.add_argument("--micro-batch-sizes", default="1,2,4,8", help="sequences per micro-batch")
    g.add_argument("--recompute", default="none,selective,full", help="recompute modes to try")
    g.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to try")
    g.add_argument("--max-virtual", type=int, default=4, help="largest interleaving factor v")
    args = ap.parse_args(argv)
    m = _model(args)
    hw = _hardware(args)
    gpn = args.gpus_per_node or hw.gpus_per_node
    gb = _global_batch(args, m, 0)
    if not gb:
        gb = parse_count("4M") // m.seq_len
    res = PL.plan(
        m, args.gpus, hw, gb, gpn, args.efficiency, args.mem_fraction,
        precision=args.precision, grad_reduce_dtype=args.grad_reduce_dtype,
        schedules=tuple(s.strip() for s in args.schedules.split(",")),
        micro_batch_sizes=tuple(int(x) for x in args.micro_batch_sizes.split(",")),
        recomputes=tuple(s.strip() for s in args.recompute.split(",")),
        zeros=tuple(int(x) for x in args.zero.split(",")), max_virtual=args.max_virtual)
    top = res.ranked[:args.top]
    if args.json:
        doc = {"model": m.name, "seq_len": m.seq_len, "gpus": args.gpus, "gpus_per_node": gpn,
               "hardware": hw.as_dict(), "global_batch": gb, "global_batch_tokens": gb * m.seq_len,
               "efficiency": args.efficiency, "counts": res.counts, "reasons": res.reasons,
               "top": [p.as_dict() for p in top]}
        if not top and res.smallest_unfit:
            doc["smallest_unfit"] = res.smallest_unfit.as_dict()
        print(json.dumps(doc, indent=2))
        return 0 if top else 1
    from rich.table import Table

    con = _console()
    con.print(f"[bold]fived plan[/]: {m.name} ({fmt_n(P.total_params(m))} params, seq {m.seq_len})"
              f" on {args.gpus}× {hw.name} ({gpn} per node) · global batch {gb} × {m.seq_len} = "
              f"{fmt_n(gb * m.seq_len)} tokens · {args.precision}")
    c = res.counts
    con.print(f"considered {c.get('evaluated', 0)} layouts: {c.get('fit', 0)} fit, "
              f"{c.get('out_of_memory', 0)} do not fit in {fmt_b(hw.memory * args.mem_fraction)}, "
              f"{c.get('invalid', 0)} invalid for the model, {c.get('zero3_pp', 0)} skipped as "
              f"ZeRO-3 with pp, {c.get('iron_rule', 0)} (tp, cp) pairs break the iron rule "
              f"(tp·cp > {gpn} GPUs per node)")
    if not top:
        s = res.smallest_unfit
        con.print("[bold red]no layout fits[/]" + (
            f": the smallest needs {fmt_b(s.memory.total)} ({s.name()})" if s else ""))
        return 1
    t = Table(title=f"top {len(top)} layouts by predicted step time")
    for col in ("#", "layout", "m", "mem/rank", "bubble", "tp", "cp", "ep", "pp", "dense",
                "step", "tokens/s", "MFU"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for i, p in enumerate(top, 1):
        tr = p.traffic
        t.add_row(str(i), p.name(), str(p.par.micro_batches), fmt_b(p.memory.total),
                  f"{p.bubble:.1%}", *(fmt_b(tr.get(g, 0)) if tr.get(g) else "-"
                                       for g in ("tp", "cp", "ep", "pp", "dense")),
                  fmt_s(p.step_seconds), fmt_n(p.tokens_per_s), f"{p.mfu:.1%}")
    con.print(t)
    con.print("[dim]traffic columns: bytes one rank sends per step on each group (slowest "
              "pipeline rank); mem/rank: the largest rank[/]")
    con.print("[bold]why the best one wins[/]")
    for r in res.reasons:
        con.print(f"  • {r}")
    best = top[0]
    con.print(f"run the ledger of the winner: fived ledger --model {args.model} "
              f"--gpus {args.gpus} --gpu {args.gpu} " + _flags(best) +
              (f" --seq-len {args.seq_len}" if args.seq_len else ""))
    return 0


def _flags(p: PL.Prediction) -> str:
    par = p.par
    out = [f"--{d} {par.degree(d)}" for d in ("tp", "cp", "ep", "pp", "dp") if par.degree(d) > 1]
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
    out.append(f"--micro-batches {par.micro_batches} --global-batch {p.global_batch}")
    return " ".join(out)


# ------------------------------------------------------------------------ fived ledger
LEDGER_EXAMPLES = """examples:
  fived ledger --model llama2-7b --gpus 8 --gpu rtx-pro-6000 --zero 3
  fived ledger --model llama3-70b --gpus 64 --gpu h100-sxm --tp 8 --pp 4 --sequence-parallel \\
               --zero 1 --micro-batches 64 --global-batch-tokens 4M --seq-len 8192
  fived ledger --model tiny --gpus 2 --precision fp32 --global-batch 8 --json

What it shows: the parameter count and the two headline numbers (a bf16 checkpoint is 2Ψ bytes,
mixed-precision Adam training state 16Ψ), then for this layout every term of the largest rank's
memory (model states by ZeRO stage, activations with the pipeline in-flight factor, buffers),
FLOPs per token (attention not causal-halved), every collective each dimension runs per step
with its bytes (the runtime's Traffic units) and alpha-beta time, and the predicted step time,
bubble, tokens/s and MFU. --dp defaults to what the other degrees leave of --gpus.
"""


def main_ledger(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="fived ledger", description="The full memory / FLOPs / traffic / time breakdown "
        "of one layout.", epilog=LEDGER_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(ap)
    g = ap.add_argument_group("layout (world = pp·dp·ep·cp·tp)")
    for d in DIMS:
        g.add_argument(f"--{d}", type=int, default=None, help=f"{d} degree")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    g.add_argument("--schedule", default=None, help="gpipe | 1f1b | interleaved | zb-h1")
    g.add_argument("--virtual-stages", type=int, default=1, help="interleaved: chunks per rank")
    g.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step")
    g.add_argument("--sequence-parallel", action="store_true", help="SP with tp")
    g.add_argument("--recompute", default="none", help="none | selective | full")
    g.add_argument("--cp-mode", default="ring", help="ring | ulysses")
    g.add_argument("--pp-layers", default=None,
                   help="layers per (virtual) stage by hand, e.g. 33,31,31,31")
    g.add_argument("--no-overlap", action="store_true", help="expose all data-parallel comm")
    g.add_argument("--eager-activations", action="store_true",
                   help="activations as the fived runtime's eager PyTorch saves them (K/V "
                        "repeated to the heads, fp32 RMSNorm intermediates); default: fused "
                        "GPU kernels (flash attention, fused RMSNorm)")
    g.add_argument("--check", default=None, metavar="METRICS_JSONL",
                   help="compare the ledger with a `fived train --metrics-out` file, exactly; "
                        "exit 1 on any byte of difference. The file's first line records the "
                        "run (model, layout, precision, global batch), which is then used and "
                        "the layout flags are ignored; for a file without it, give the run's "
                        "layout, --precision and --global-batch")
    g.add_argument("--train-tokens", default="1T",
                   help="token budget for the time wall, decimal (default 1T = 1e12)")
    args = ap.parse_args(argv)
    if args.check:
        from .verify import run_of_file

        try:
            run = run_of_file(args.check)
        except (OSError, ValueError) as e:
            raise ConfigError([f"--check {args.check}: cannot read it ({e})"]) from None
        if run is not None:  # the file says what ran: its layout, not the flags
            return _check(*run, args.check, args.json, from_file=True)
    m = _model(args)
    hw = _hardware(args)
    gpn = args.gpus_per_node or hw.gpus_per_node
    deg = {d: getattr(args, d) for d in DIMS}
    rest = 1
    for d in ("tp", "cp", "ep", "pp"):
        rest *= deg[d] or 1
    if deg["dp"] is None:
        deg["dp"] = max(1, args.gpus // rest)
    schedule = args.schedule or ("interleaved" if args.virtual_stages > 1 else "1f1b")
    par = ParallelConfig(
        **{d: deg[d] or 1 for d in DIMS}, zero=args.zero, schedule=schedule,
        virtual_stages=args.virtual_stages, micro_batches=args.micro_batches,
        sequence_parallel=args.sequence_parallel, recompute=args.recompute,
        precision=args.precision, grad_reduce_dtype=args.grad_reduce_dtype,
        cp_mode=args.cp_mode, overlap=not args.no_overlap,
        pp_layers=tuple(int(x) for x in args.pp_layers.split(",")) if args.pp_layers else ())
    gb = _global_batch(args, m, par.dp * par.ep * par.micro_batches)
    validate(m, par, world_size=args.gpus)
    if gb % (par.dp * par.ep) or (gb // (par.dp * par.ep)) % par.micro_batches:
        raise ConfigError([f"global batch {gb} sequences does not split over dp·ep = "
                           f"{par.dp * par.ep} replicas × {par.micro_batches} micro-batches"])
    if args.check:
        return _check(m, par, gb, args.check, args.json)
    if args.eager_activations:
        opts = M.ActivationOptions(args.attention, kv_repeat=True, fused_norm=False)
    else:
        opts = M.ActivationOptions(args.attention, kv_repeat=False, fused_norm=True)
    doc = ledger_document(m, par, hw, gb, gpn, args.efficiency, args.mem_fraction, opts,
                          parse_count(args.train_tokens, binary=False))
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print_ledger(doc, m, par, hw)
    return 0


def _check(m: ModelConfig, par: ParallelConfig, gb: int, path: str, as_json: bool,
           from_file: bool = False) -> int:
    from .verify import compare_file

    source = "recorded in the file" if from_file else "from the flags"

    bad = compare_file(m, par, gb, path)
    if as_json:
        print(json.dumps({"metrics": path, "layout": par.describe(), "layout_source": source,
                          "exact": not bad, "mismatches": bad}, indent=2))
    else:
        con = _console()
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
    return 1 if bad else 0


def ledger_document(m: ModelConfig, par: ParallelConfig, hw: H.Hardware, global_batch: int,
                    gpn: int, efficiency: float, mem_fraction: float,
                    opts: M.ActivationOptions, train_tokens: float) -> dict:
    """Everything ``fived ledger`` prints, as one JSON-able dict."""
    n = P.total_params(m)
    counts = P.param_counts(m)
    b = micro_batch_size(par, global_batch)
    pr = PL.predict(m, par, hw, global_batch, gpn, efficiency, mem_fraction, opts)
    ranks = P.all_rank_params(m, par)
    fwd = C.forward_flops_per_token(m)
    attn = C.attention_flops_per_token(m)
    tokens = global_batch * m.seq_len
    mf = C.model_flops_per_token(m)
    wall = C.training_flops(n, train_tokens)
    return {
        "model": {"name": m.name, "params": n, "dense": counts["dense"], "expert": counts["expert"],
                  "active": P.active_params(m), "by_kind": counts,
                  "checkpoint_bf16_bytes": M.checkpoint_bytes(m, 2),
                  "training_state_16psi_bytes": 16 * n,
                  "layout_bytes_per_param": M.bytes_per_param(par),
                  "layout_training_state_bytes": M.bytes_per_param(par) * n,
                  "device_memory": hw.memory,
                  "training_state_fits_one_device": 16 * n <= hw.memory},
        "layout": pr.as_dict()["parallel"], "layout_name": pr.name(), "world": par.world_size,
        "global_batch": global_batch, "micro_batch_size": b, "hardware": hw.as_dict(),
        "params_per_pp_rank": [{"pp_rank": r.pp_rank, "layers": r.layers, "dense": r.dense,
                                "expert": r.expert, "total": r.total, "breakdown": r.breakdown}
                               for r in ranks],
        "memory": pr.memory.as_dict(), "usable_memory": hw.memory * mem_fraction,
        "fits": pr.fits,
        "compute": {"convention": "2 FLOPs per multiply-add; attention not causal-halved",
                    "forward_per_token": fwd, "attention_forward_per_token": attn,
                    "backward_per_token": 2 * fwd, "model_per_token": mf,
                    "recompute_per_token": C.recompute_flops_per_token(m, par.recompute),
                    "model_per_step": mf * tokens, "per_rank_per_step": mf * tokens
                    / par.world_size,
                    "time_wall": {"tokens": train_tokens, "flops_6psid": wall,
                                  "seconds_at_predicted_mfu": C.training_seconds(
                                      wall, par.world_size, hw.peak_flops, max(pr.mfu, 1e-9)),
                                  "one_device_at_peak_seconds": wall / hw.peak_flops}},
        "traffic": {"pp_rank": pr.slow_rank, "bytes_by_group": pr.traffic,
                    "collectives": pr.as_dict()["collectives"]},
        "time": {"components": pr.times, "step_seconds": pr.step_seconds,
                 "tokens_per_s": pr.tokens_per_s, "mfu": pr.mfu, "bubble_fraction": pr.bubble,
                 "bubble_ticks": B.bubble_ticks(par), "efficiency": efficiency},
    }


def print_ledger(doc: dict, m: ModelConfig, par: ParallelConfig, hw: H.Hardware) -> None:
    from rich.table import Table

    con = _console()
    md = doc["model"]
    n = md["params"]
    con.print(f"[bold]fived ledger[/]: {m.name} · {doc['layout_name']} · {doc['world']}× {hw.name}"
              f" · global batch {doc['global_batch']} × {m.seq_len} tokens · {par.precision}")
    t = Table(title="the model and the two walls")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("how")
    t.add_row("parameters Ψ", f"{n:,}", f"dense {md['dense']:,}, expert {md['expert']:,}, "
              f"active/token {md['active']:,}")
    t.add_row("checkpoint (bf16 weights)", fmt_b(md["checkpoint_bf16_bytes"]), "2Ψ")
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
    con.print(t)

    t = Table(title="parameters per pipeline rank (any tp/cp/ep/dp coordinate)")
    for col in ("pp rank", "layers", "dense", "expert", "total", "embed", "head"):
        t.add_column(col, justify="right")
    for r in doc["params_per_pp_rank"]:
        bd = r["breakdown"]
        t.add_row(str(r["pp_rank"]), str(r["layers"]), f"{r['dense']:,}", f"{r['expert']:,}",
                  f"{r['total']:,}", f"{bd.get('embed', 0):,}", f"{bd.get('head', 0):,}")
    con.print(t)

    mem = doc["memory"]
    t = Table(title=f"memory of the largest rank (pp rank {mem['pp_rank']}; in-flight "
                    f"micro-batches {mem['inflight_microbatches']:.2f})")
    t.add_column("part")
    t.add_column("term")
    t.add_column("bytes", justify="right")
    for k, v in mem["states"].items():
        t.add_row("model states", k, fmt_b(v))
    for k, v in mem["activations"].items():
        t.add_row("activations", k, fmt_b(v))
    for k, v in mem["buffers"].items():
        t.add_row("comm buffers", k, fmt_b(v))
    t.add_row("[bold]total[/]", "", f"[bold]{fmt_b(mem['total'])}[/]")
    ok = "[green]fits[/]" if doc["fits"] else "[bold red]does not fit[/]"
    t.add_row("device", f"{hw.name} usable", f"{fmt_b(doc['usable_memory'])} — {ok}")
    con.print(t)

    c = doc["compute"]
    t = Table(title=f"compute ({c['convention']})")
    t.add_column("quantity")
    t.add_column("FLOPs", justify="right")
    t.add_row("forward per token", f"{c['forward_per_token']:.3e}")
    t.add_row("  of which attention (4·L·s·h_attn)", f"{c['attention_forward_per_token']:.3e}")
    t.add_row("backward per token (2× forward)", f"{c['backward_per_token']:.3e}")
    t.add_row("model FLOPs per token", f"{c['model_per_token']:.3e}")
    t.add_row(f"recompute per token ({par.recompute}; not model FLOPs)",
              f"{c['recompute_per_token']:.3e}")
    t.add_row("model FLOPs per step", f"{c['model_per_step']:.3e}")
    t.add_row("per rank per step", f"{c['per_rank_per_step']:.3e}")
    con.print(t)

    tr = doc["traffic"]
    t = Table(title=f"traffic per step, pipeline rank {tr['pp_rank']} (bytes this rank sends)")
    for col in ("group", "op", "what", "S", "n", "calls", "bytes", "link", "time"):
        t.add_column(col, justify="left" if col in ("group", "op", "what", "link") else "right")
    for x in tr["collectives"]:
        t.add_row(x["group"], x["op"], x["what"], fmt_b(x["size"]), str(x["n"]), str(x["count"]),
                  fmt_b(x["bytes"]), x["link"], fmt_s(x["seconds"]))
    for g, v in tr["bytes_by_group"].items():
        t.add_row(f"[bold]{g}[/]", "", "total", "", "", "", f"[bold]{fmt_b(v)}[/]", "", "")
    con.print(t)

    tm = doc["time"]
    t = Table(title=f"time per step (efficiency {tm['efficiency']:.0%} of peak in matmuls)")
    t.add_column("component")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    for k, v in tm["components"].items():
        if v:
            t.add_row(k, fmt_s(v), f"{v / tm['step_seconds']:.1%}")
    t.add_row("[bold]step[/]", f"[bold]{fmt_s(tm['step_seconds'])}[/]", "")
    t.add_row("bubble fraction", f"{tm['bubble_fraction']:.2%}", "")
    t.add_row("tokens/s", fmt_n(tm["tokens_per_s"]), "")
    t.add_row("MFU", f"{tm['mfu']:.1%}", "")
    con.print(t)


if __name__ == "__main__":
    sys.exit(main_ledger(sys.argv[1:]))
