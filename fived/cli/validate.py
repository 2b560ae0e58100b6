"""``fived ledger --validate``: the clock beside every published run of ``runs.toml``.

One row per run: GPUs, layout, published MFU (the source's own convention), predicted MFU in
that convention, the error in points, predicted / published tokens per second, and the
predicted memory of the largest rank. Then the median and worst absolute error, and (``--refit``)
the grid search of the clock's global constants. ``--plot PNG`` draws predicted against
published MFU (matplotlib), the figure in docs/ledger.md.
"""

from __future__ import annotations

import argparse

from ..ui import report


def main(args: argparse.Namespace) -> int:
    from ..ledger import validate as validation

    con = report.console(args.wide)
    runs = validation.load()
    if not args.json:
        con.print(f"fived ledger --validate: {len(runs)} published runs ({validation.RUNS.name}); "
                  "predicting each ...")
    checks = validation.check_all(runs)
    # the calibration's targets are for the bf16/fp16 rows; the fp8 rows are reported apart
    summ = validation.summary([c for c in checks if c.run.par.fp8 == "none"])
    f8 = [c for c in checks if c.run.par.fp8 != "none"]
    summ_fp8 = validation.summary(f8) if f8 else None
    fit = None
    if args.refit:
        if not args.json:
            con.print("refitting the clock's global constants on a grid (a minute) ...")
        consts, fs = validation.fit(runs)
        fit = {"constants": consts, "summary": fs}
    if args.json:
        report.print_json({"runs": [_row(c) for c in checks], "summary": summ,
                           "summary_fp8": summ_fp8, "refit": fit})
    else:
        cols = [("run", "l")] + ([("GPUs", "r")] if args.wide else []) + [
            ("layout", "l"), ("pub", "r"), ("pred", "r"), ("Δ pts", "r"), ("tok/s", "r")]
        cols += [("mem", "r")] if args.wide else []
        t = report.table("the clock against published runs (MFU in each source's convention)",
                         cols)
        # the layout column takes what the others leave of 80 columns, broken between its
        # parts (tp8·pp16·...), never inside a word
        others = max(len(c.run.name) for c in checks) + 4 + 6 + 6 + 6 + 2 * 5
        room = 10**6 if args.wide else max(report.WIDTH - others - 4, 12)
        for c in checks:
            row = [c.run.name] + ([str(c.run.gpus)] if args.wide else [])
            row += [report.break_after(c.pred.name(), room), f"{c.run.mfu:.0%}",
                    f"{c.mfu_pred:.1%}",
                    f"{c.error_points:+.1f}", f"{c.ratio:.2f}×"]
            row += [report.fmt_b(c.pred.memory.peak)] if args.wide else []
            t.add_row(*row)
        report.show(con, t)
        con.print(f"median |error| {summ['median_abs_error_points']:.1f} points (target ≤ 3), "
                  f"worst {summ['worst_abs_error_points']:.1f} ({summ['worst_run']}; target ≤ 8), "
                  f"mean {summ['mean_error_points']:+.1f}. tok/s = predicted / published "
                  "throughput; --wide adds the predicted memory of the largest rank (no source "
                  "publishes memory). Over the bf16/fp16 rows.")
        if summ_fp8:
            con.print("fp8 rows (" + ", ".join(f"{c.run.name} {c.ratio:.2f}×" for c in f8)
                      + f"): median |error| {summ_fp8['median_abs_error_points']:.1f} points, "
                      f"worst {summ_fp8['worst_abs_error_points']:.1f}; never fitted: the clock "
                      "runs their linears at the fp8 peak and counts no cast (docs/ledger.md).")
        if fit:
            c = ", ".join(f"{k} {v:g}" for k, v in fit["constants"].items())
            fs = fit["summary"]
            con.print(f"refit: {c} → median {fs['median_abs_error_points']:.1f}, worst "
                      f"{fs['worst_abs_error_points']:.1f} ({fs['worst_run']})")
    if args.plot:
        plot(checks, args.plot)
        if not args.json:
            con.print(f"figure: {args.plot}")
    return 0


def _row(c) -> dict:
    return {"run": c.run.name, "family": c.run.family, "gpu": c.run.gpu, "gpus": c.run.gpus,
            "layout": c.pred.name(), "fp8": c.run.par.fp8, "published_mfu": c.run.mfu,
            "predicted_mfu": c.mfu_pred,
            "error_points": c.error_points, "throughput_ratio": c.ratio,
            "predicted_memory": c.pred.memory.peak, "flops_convention": c.run.flops,
            "times": c.pred.times, "source": c.run.source}


def plot(checks, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.6), dpi=110)
    fams = sorted({c.run.family for c in checks})
    for fam, mark in zip(fams, "os^D"):
        cs = [c for c in checks if c.run.family == fam]
        ax.scatter([100 * c.run.mfu for c in cs], [100 * c.mfu_pred for c in cs], marker=mark,
                   label=f"{fam} ({cs[0].run.gpu})")
        for c in cs:
            ax.annotate(c.run.name.split("-", 1)[1], (100 * c.run.mfu, 100 * c.mfu_pred),
                        fontsize=6, xytext=(3, 2), textcoords="offset points")
    lo, hi = 30, 65
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    for d in (3, 8):
        ax.plot([lo, hi], [lo + d, hi + d], "k:", lw=0.6)
        ax.plot([lo, hi], [lo - d, hi - d], "k:", lw=0.6)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published MFU (%)")
    ax.set_ylabel("predicted MFU (%)")
    ax.set_title("fived's clock vs published runs (dotted: ±3, ±8 points)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
