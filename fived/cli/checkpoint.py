"""``fived checkpoint inspect DIR``: what a checkpoint holds, without loading a tensor.

Prints the step, the layout it was saved under, the tensors (grouped: parameters, fp32
masters, each optimizer state, RNG) with their bytes, and the model-state bytes each rank held
when it saved (the engine's measured ``memory()``) against the ledger's formula for that layout
(``fived.ledger.memory.model_states``). ``--files`` also lists the files with their checksums
verified; ``--json`` prints the manifest.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import ConfigError, ModelConfig, ParallelConfig
from ..ui import report
from ..ui.args import Parser

KEYS = ("params", "grads", "master", "optimizer", "padding")


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived checkpoint", description="Inspect a fived checkpoint (fived train "
        "--save-dir DIR). DIR: a save directory (its newest complete checkpoint) or DIR/step-N.",
        epilog="example:\n  fived checkpoint inspect runs/ck\n  fived checkpoint inspect "
        "runs/ck/step-000040 --files", formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True, metavar="inspect")
    ins = sub.add_parser("inspect", help="step, layout, tensors and bytes, bytes per rank vs "
                         "the ledger")
    ins.add_argument("dir", metavar="DIR")
    ins.add_argument("--files", action="store_true",
                     help="verify every file's size and sha256 and list them")
    ins.add_argument("--json", action="store_true", help="print the manifest as JSON")
    return ap


def groups(tensors: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(kind, tensors, bytes) per kind: model, master, optim.S, rng."""
    out: dict[str, list[int]] = {}
    for name, t in tensors.items():
        head = name.split(".")[0]
        kind = f"optim.{name.split('.')[1]}" if head == "optim" else head
        row = out.setdefault(kind, [0, 0])
        row[0] += 1
        row[1] += t["bytes"]
    return [(k, v[0], v[1]) for k, v in out.items()]


def ledger_rows(man: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(rank, measured model-state bytes, the ledger's) for each rank that saved."""
    from ..ledger.verify import predict_rank

    m = ModelConfig(**man["config"]["model"])
    par = ParallelConfig(**{k: tuple(v) if isinstance(v, list) else v
                            for k, v in man["config"]["parallel"].items()})
    train = man["config"].get("train", {})
    opt, batch = train.get("optimizer", "adamw"), int(train.get("global_batch", 16))
    rows = []
    for r, mem in enumerate(man.get("memory_per_rank") or []):
        led = predict_rank(m, par, batch, r, opt)[0]
        rows.append((r, float(sum(mem.get(k, 0) for k in KEYS)),
                     float(sum(led.get(k, 0) for k in KEYS))))
    return rows


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from ..checkpoint.storage import check_metadata, read_manifest, resolve, verify

    print(f"fived checkpoint inspect {args.dir} ...", flush=True,
          file=sys.stderr if args.json else sys.stdout)  # --json: stdout is the document
    ckpt = resolve(args.dir, "fived checkpoint inspect")
    man = (verify if args.files else read_manifest)(ckpt, "fived checkpoint inspect")
    check_metadata(ckpt, "fived checkpoint inspect")
    if args.json:
        report.print_json(man)
        return 0
    con = report.console()
    m, p = man["config"]["model"], man["config"]["parallel"]
    layout = " ".join(f"{d}{p[d]}" for d in ("tp", "cp", "ep", "dp", "pp") if p.get(d, 1) > 1)
    con.print(f"[bold]{ckpt}[/]  step {man['step']}  ·  model {m['name']} "
              f"({'MoE' if m.get('experts') else 'dense'})  ·  saved under "
              f"{layout or 'one rank'} ZeRO-{p.get('zero', 0)} {p.get('precision')}  ·  "
              f"{man['world']} rank(s)")
    if man.get("imported_from"):
        con.print(f"imported from {man['imported_from']} (no optimizer state)")
    t = report.table("tensors", [("kind", "l"), ("tensors", "r"), ("bytes", "r")])
    total = 0
    for kind, n, b in groups(man["tensors"]):
        t.add_row(kind, str(n), report.fmt_b(b))
        total += b
    t.add_row("total", str(len(man["tensors"])), report.fmt_b(total))
    report.show(con, t)
    rows = ledger_rows(man)
    rss = man.get("rss_per_rank") or []
    if rows:
        t = report.table("model-state bytes per rank when saved (params+grads+master+optimizer"
                         "+padding); peak RSS measured", [
                             ("rank", "r"), ("measured", "r"), ("ledger", "r"), ("equal", "l"),
                             ("RSS build", "r"), ("RSS peak", "r")])
        for r, meas, led in rows:
            b, pk = (report.fmt_b(rss[r]["build"]), report.fmt_b(rss[r]["peak"])) if (
                r < len(rss)) else ("", "")
            t.add_row(str(r), report.fmt_b(meas), report.fmt_b(led),
                      "yes" if abs(meas - led) < 0.5 else f"differs by {meas - led:+.0f} B",
                      b, pk)
        report.show(con, t)
    if args.files:
        t = report.table("files (size and sha256 verified)", [("file", "l"), ("bytes", "r"),
                                                              ("sha256", "l")])
        for name, f in man["files"].items():
            t.add_row(name, report.fmt_b(f["bytes"]), f["sha256"][:16] + "…")
        report.show(con, t)
    return 0


__all__ = ["ConfigError", "main"]
