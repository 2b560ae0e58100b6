"""``fived bench ep``: step time of ep ∈ {1, 2, 4} on the same global batch, and the
all-to-all's share of it.

Each layout trains the same MoE model on the same global batch (ep ranks read different
sequences, so ep = n is also n-way data parallel for the dense part) for ``--steps`` steps on
``ep`` local gloo ranks. The table gives, per ep: the median step time after the first step,
tokens/s, the all-to-all seconds per step (max over ranks) and their share of the step (mean
over ranks), the ep bytes one rank sent (measured) against the balanced-routing estimate
``fived.ledger.traffic.ep_traffic``, the expert-parameter bytes per rank, and the last
loss (the same on every layout: parity). Times on a shared CPU are noise; the shares and the
bytes are the result.

Then grouped against looped expert matmuls (``expert_matmul``, ``fived.model.grouped``): one
rank's experts, forward and backward over routed rows sorted by expert, at 8, 32 and 128
experts per rank (``--experts-per-rank``; tiny ``--matmul-hidden``/``--matmul-ffn`` so it
takes seconds; ``--matmul-rows`` rows per expert on average, routed uniformly at random,
empty experts included). The two alternate inside each of ``--matmul-reps`` repetitions (the
order flips each time), each timing ``--matmul-iters`` passes; the table gives both medians,
their ratio (grouped / loop) and the median of the per-repetition ratios (the JSON's
``ratio``). Both must give the same output and gradients (checked, 1e-5).

    fived bench ep                         # tiny-moe, ep 1,2,4, 6 steps, global batch 16
    fived bench ep --eps 1,2 --steps 10 --json
    fived bench ep --matmul-only --experts-per-rank 8,32,128 --matmul-reps 21
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from ..ui import flags
from ..ui.args import Parser
from . import schema


def _rank(rank: int, world: int, model: Any, par: Any, train: Any) -> dict[str, Any]:
    from ..train.trainer import train_rank

    return train_rank(rank, world, model, par, train, show=False)


def measure(model: Any, ep: int, train: Any, timeout: float = 600.0) -> dict[str, Any]:
    """Train one layout; the row of the closing table."""
    from ..config import ParallelConfig
    from ..ledger.params import expert_param_bytes
    from ..ledger.traffic import bytes_by_group, ep_traffic, micro_batch_size
    from ..ranks.launch import run_local

    par = ParallelConfig(ep=ep)
    t0 = time.perf_counter()
    out = run_local(_rank, ep, (model, par, train), timeout=timeout)
    wall = time.perf_counter() - t0
    hist = out[0]["history"]
    steady = hist[1:] or hist
    step_s = statistics.median(h["seconds"] for h in steady)
    tokens = train.global_batch * model.seq_len
    ep_bytes = max(t["bytes"].get("ep", 0.0) for t in hist[-1]["traffic_per_rank"])
    return {
        "ep": ep,
        "ranks": ep,
        "step_ms": 1000 * step_s,
        "tokens_per_s": tokens / step_s,
        "a2a_ms": 1000 * statistics.median(h["moe"]["a2a_seconds"] for h in steady),
        "a2a_share": statistics.median(h["moe"]["a2a_share"] for h in steady),
        "ep_bytes_per_rank": ep_bytes,
        "ep_bytes_uniform": bytes_by_group(ep_traffic(
            model, par, micro_batch_size(par, train.global_batch))).get("ep", 0.0),
        "expert_bytes_per_rank": expert_param_bytes(model, ep),
        "dropped": sum(h["moe"]["dropped"] for h in hist),
        "loss_last": hist[-1]["loss"],
        "wall_s": wall,
    }


def matmul_times(experts: int, hidden: int, ffn: int, rows_per_expert: int, reps: int,
                 iters: int, seed: int = 0) -> dict[str, Any]:
    """Forward + backward seconds of ``experts`` SwiGLU experts (fp32, this process) over
    ``experts · rows_per_expert`` rows routed uniformly at random: the loop of ``Expert``
    modules against ``grouped_experts``, alternating; per repetition the mean of ``iters``
    passes. Both variants' outputs and gradients are checked equal first."""
    import torch

    from ..model.grouped import grouped_experts, grouped_supported
    from ..model.moe import Expert

    torch.manual_seed(seed)
    mods = [Expert(hidden, ffn, torch.float32) for _ in range(experts)]
    n = experts * rows_per_expert
    counts = torch.bincount(torch.randint(0, experts, (n,)), minlength=experts).tolist()
    x = torch.randn(n, hidden, requires_grad=True)
    dy = torch.randn(n, hidden)
    params = [p for m in mods for p in m.parameters()]

    def loop() -> Any:
        return torch.cat([m(c) for m, c in zip(mods, torch.split(x, counts))])

    def grouped() -> Any:
        return grouped_experts(x, counts, mods)

    def run(fn: Any) -> list[Any]:
        for p in [x, *params]:
            p.grad = None
        y = fn()
        y.backward(dy)
        return [y.detach(), x.grad, *(p.grad for p in params)]

    for a, b in zip(run(loop), run(grouped)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    fns = {"loop": loop, "grouped": grouped}
    times: dict[str, list[float]] = {"loop": [], "grouped": []}
    for rep in range(reps + 1):  # the first repetition warms up, untimed
        for name in (("loop", "grouped") if rep % 2 else ("grouped", "loop")):
            t = 0.0
            for _ in range(iters):
                for p in [x, *params]:
                    p.grad = None
                t0 = time.perf_counter()
                fns[name]().backward(dy)
                t += time.perf_counter() - t0
            if rep:
                times[name].append(t / iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"experts": experts, "rows": n, "empty_experts": counts.count(0),
            "kernel": grouped_supported(x, hidden, ffn), "loop_s": med["loop"],
            "grouped_s": med["grouped"], "ratio_of_medians": med["grouped"] / med["loop"],
            "paired_ratio": statistics.median(g / b for g, b in zip(times["grouped"],
                                                                    times["loop"])),
            "times": times}


def matmul_table(con: Any, rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    """The grouped-vs-loop table (80 columns)."""
    from rich.table import Table

    t = Table(title=f"grouped vs loop expert matmuls: h {a.matmul_hidden}, ffn "
                    f"{a.matmul_ffn}, fp32, fwd+bwd", header_style="bold")
    for c in ("experts/rank", "rows", "empty", "loop ms", "grouped ms", "ratio", "paired"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["experts"]), str(r["rows"]), str(r["empty_experts"]),
                  f"{1e3 * r['loop_s']:.2f}", f"{1e3 * r['grouped_s']:.2f}",
                  f"{r['ratio_of_medians']:.2f}×", f"{r['paired_ratio']:.2f}×")
    con.print(t)
    kern = "torch._grouped_mm" if all(r["kernel"] for r in rows) else "the per-expert fallback"
    con.print(f"ratio = median grouped / median loop over {a.matmul_reps} alternating "
              f"repetitions ({a.matmul_iters} passes each); paired = median of the "
              f"per-repetition ratios; grouped ran {kern}; outputs and gradients equal (1e-5).",
              highlight=False, width=80)


def _layouts(con: Any, model: Any, eps: list[int], train: Any, a: argparse.Namespace
             ) -> list[dict[str, Any]]:
    """Train every ep layout; print the layouts' table; their rows."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    con.print(f"[bold]fived bench ep[/]: {model.name} ({model.experts} experts, top-{model.top_k}, "
              f"{'dropless' if model.capacity_factor <= 0 else f'capacity {model.capacity_factor}'}"
              f") · ep {', '.join(map(str, eps))} · {a.steps} steps · global batch "
              f"{a.global_batch}×{model.seq_len} tokens · gloo on this CPU", highlight=False)
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(bar_width=20),
                  TextColumn("{task.completed}/{task.total} layouts"), TimeElapsedColumn(),
                  console=con, transient=False) as prog:
        task = prog.add_task("ep 1", total=len(eps))
        for ep in eps:
            prog.update(task, description=f"training ep {ep} on {ep} rank(s)")
            r = measure(model, ep, train)
            rows.append(r)
            prog.console.print(f"  ep {ep}: step {r['step_ms']:.1f} ms, all-to-all "
                               f"{100 * r['a2a_share']:.1f}% of it, loss {r['loss_last']:.5f}",
                               highlight=False)
            prog.advance(task)
    t = Table(title=f"fived bench ep — {model.name}, same global batch", header_style="bold")
    for c in ("ep", "step ms", "vs ep1", "tok/s", "a2a ms", "a2a %", "ep KiB", "bal. KiB",
              "exp. KiB", "loss"):
        t.add_column(c, justify="right")
    base = rows[0]["step_ms"]
    for r in rows:
        t.add_row(str(r["ep"]), f"{r['step_ms']:.1f}", f"{r['step_ms'] / base:.2f}×",
                  f"{r['tokens_per_s']:.0f}", f"{r['a2a_ms']:.1f}", f"{100 * r['a2a_share']:.1f}",
                  f"{r['ep_bytes_per_rank'] / 1024:.0f}", f"{r['ep_bytes_uniform'] / 1024:.0f}",
                  f"{r['expert_bytes_per_rank'] / 1024:.0f}", f"{r['loss_last']:.4f}")
    con.print(t)
    con.print("a2a % = all-to-all seconds (counts + dispatch + combine, forward and backward) / "
              "step seconds, mean over ranks; ep sent = bytes one rank sent on ep per step (max "
              "rank), bal. = the uniform-routing estimate; exp. = expert-parameter bytes per rank; "
              f"dropped assignments: {[r['dropped'] for r in rows]}. ep = n also splits the "
              "batch n ways.", highlight=False)
    first = rows[0]["loss_last"]
    for r in rows[1:]:  # every layout trains the same model on the same batch: parity
        assert abs(r["loss_last"] - first) <= 1e-4 * abs(first), (
            f"ep {r['ep']}: last loss {r['loss_last']} != ep {rows[0]['ep']}'s {first}")
    return rows


@schema.json_stdout
def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from ..config import ConfigError, ParallelConfig, TrainConfig, preset, validate

    ap = Parser(prog="fived bench ep", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flag(ap, "model", default="tiny-moe", help="a MoE preset")
    ap.add_argument("--eps", default="1,2,4", help="ep degrees to compare (default 1,2,4)")
    flags.add_flag(ap, "steps", default=6, help="optimizer steps per layout")
    flags.add_flag(ap, "global_batch", default=16, help="sequences per step (all layouts)")
    flags.add_flag(ap, "seq_len", default=None, shown_as="the preset's")
    ap.add_argument("--top-k", type=int, default=None, help="override the model's top_k")
    ap.add_argument("--capacity-factor", type=float, default=None, help="0: dropless")
    ap.add_argument("--experts-per-rank", default="8,32,128",
                    help="grouped vs loop: experts per rank to time (default 8,32,128)")
    ap.add_argument("--matmul-hidden", type=int, default=64, help="grouped vs loop: hidden")
    ap.add_argument("--matmul-ffn", type=int, default=32, help="grouped vs loop: expert ffn")
    ap.add_argument("--matmul-rows", type=int, default=16,
                    help="grouped vs loop: routed rows per expert, on average")
    ap.add_argument("--matmul-reps", type=int, default=15,
                    help="grouped vs loop: alternating repetitions (median)")
    ap.add_argument("--matmul-iters", type=int, default=3,
                    help="grouped vs loop: passes per repetition")
    ap.add_argument("--matmul-only", action="store_true",
                    help="only the grouped-vs-loop comparison (no training)")
    ap.add_argument("--json", action="store_true", help="print the fived.bench JSON document "
                    "(docs/benchmarks.md) as the last line")
    argv = sys.argv[1:] if argv is None else argv
    a = flags.parse(ap, argv)
    model = preset(a.model)
    over = {k: v for k, v in (("seq_len", a.seq_len), ("top_k", a.top_k),
                              ("capacity_factor", a.capacity_factor)) if v is not None}
    model = replace(model, **over)
    try:
        eps = [int(x) for x in a.eps.split(",")]
        train = TrainConfig(model=model.name, steps=a.steps, global_batch=a.global_batch,
                            warmup=1, seed=1234)
        for ep in eps:
            validate(model, ParallelConfig(ep=ep), train, ep)
        per_rank = [int(x) for x in a.experts_per_rank.split(",")]
        for what, v in (("--experts-per-rank", min(per_rank)), ("--matmul-hidden",
                        a.matmul_hidden), ("--matmul-ffn", a.matmul_ffn), ("--matmul-rows",
                        a.matmul_rows), ("--matmul-reps", a.matmul_reps),
                        ("--matmul-iters", a.matmul_iters)):
            if v < 1:
                raise ConfigError(f"{what} {v}: must be at least 1")
    except (ValueError, ConfigError) as e:
        print(f"fived bench ep: {e}", file=sys.stderr)
        return 2
    con = Console()
    con.width = max(con.width, 100)
    rows = [] if a.matmul_only else _layouts(con, model, eps, train, a)
    con.print(f"[bold]grouped vs loop[/]: {', '.join(map(str, per_rank))} experts/rank, "
              f"~{a.matmul_rows} rows each, {a.matmul_reps} reps × {a.matmul_iters} passes, "
              f"{torch_threads()} thread(s)", highlight=False, width=80)
    mm = [matmul_times(e, a.matmul_hidden, a.matmul_ffn, a.matmul_rows, a.matmul_reps,
                       a.matmul_iters) for e in per_rank]
    matmul_table(con, mm, a)
    if a.json:
        schema.emit(_document(argv, a, model, rows, mm))
    return 0


def _document(argv: list[str], a: argparse.Namespace, model: Any, rows: list[dict],
              mm: list[dict]) -> dict:
    """``fived.bench`` rows: variant "ep", implementation "fived epN", the first layout (ep 1
    by default) the peer; bytes_sent = ep bytes one rank sent (the max rank). Then variant
    "experts E": implementations "loop" (the peer) and "grouped", step_s = the median
    forward + backward seconds, ``times_s`` the repetitions' (so ``ratio`` is the paired
    median; ``ratio_of_medians`` in each grouped row's extra)."""
    out = [schema.row("ep", f"fived ep{r['ep']}", r["step_ms"] / 1e3, peer=i == 0,
                      bytes_sent=r["ep_bytes_per_rank"], **r) for i, r in enumerate(rows)]
    for r in mm:
        info = {k: r[k] for k in ("experts", "rows", "empty_experts", "kernel")}
        info |= {"hidden": a.matmul_hidden, "ffn": a.matmul_ffn}
        out.append(schema.row(f"experts {r['experts']}", "loop", r["loop_s"], peer=True,
                              times_s=r["times"]["loop"], **info))
        out.append(schema.row(f"experts {r['experts']}", "grouped", r["grouped_s"],
                              times_s=r["times"]["grouped"],
                              ratio_of_medians=r["ratio_of_medians"], **info))
    return schema.document("ep", argv, out, settings=vars(a), extra={"model": model.name},
                           mach=schema.machine(threads_per_rank=torch_threads()))


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    sys.exit(main())
