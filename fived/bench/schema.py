"""The one JSON shape every ``fived bench NAME --json`` prints: ``fived.bench`` version 1.

A document (a JSON object)::

    {"schema": "fived.bench", "version": 1,
     "bench": "ddp",                          # the NAME of `fived bench NAME`
     "command": "fived bench ddp --reps 9",   # how to run it again
     "machine": {"host", "cpus", "loadavg_1m", "torch", "python", "threads_per_rank",
                 "backend", "device", "date"},
     "settings": {...},                       # the bench's arguments (free-form)
     "rows": [ROW, ...],
     "extra": {...}}                          # bench-wide extras (free-form, see below)

A ROW is one (variant, implementation) measured::

    variant         str    what is compared (same variant = same work): "dp", "zero3",
                           "tp+sp", "1f1b", "all_reduce 16M", "ring", "ep2" ...
    implementation  str    who ran it: "fived", "fived no-overlap", "torch DDP", "torch FSDP2",
                           "DTensor", "torch", "backend", "ring" ...
    peer            bool   this row is the variant's reference (its ratio is 1.0)
    step_s          float  median seconds of one step (one collective for comm), slowest rank
    ratio           float|None  against the peer row of the same variant: the median over the
                           repetitions of (this repetition's time / the peer's), the two run
                           back to back — or step_s / peer step_s where a bench keeps no
                           per-repetition times (``ratio``); None: the variant has no peer
    state_bytes     int|None    model-state bytes per rank (params + grads + master + optimizer
                           state as held), None where the bench holds no model
    bytes_sent      float|None  bytes one rank sent per step (fived.comm's Traffic; the
                           maximum over ranks), None where not measured (torch's collectives)
    optimizer_s     float|None  median seconds of the optimizer step alone (clip + AdamW),
                           None where the bench runs no optimizer
    extra           dict   the row's bench-specific values (free-form; documented per bench in
                           docs/benchmarks.md): losses, gradient gaps, busbw, comm hidden ...;
                           ``times_s``: the per-repetition times, where the bench keeps them

``validate(doc)`` raises ``ValueError`` naming the first field that is missing or of the wrong
type; every bench's test runs it on the bench's real output.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Any

SCHEMA = "fived.bench"
VERSION = 1
ROW_FIELDS: dict[str, tuple[type, ...]] = {
    "variant": (str,), "implementation": (str,), "peer": (bool,), "step_s": (float, int),
    "ratio": (float, int, type(None)), "state_bytes": (int, type(None)),
    "bytes_sent": (float, int, type(None)), "optimizer_s": (float, int, type(None)),
    "extra": (dict,),
}
DOC_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,), "version": (int,), "bench": (str,), "command": (str,), "machine": (dict,),
    "settings": (dict,), "rows": (list,), "extra": (dict,),
}
MACHINE_FIELDS = ("host", "cpus", "loadavg_1m", "torch", "python", "threads_per_rank", "backend",
                  "device", "date")


def machine(backend: str = "gloo", device: str = "cpu", threads_per_rank: int | None = None
            ) -> dict[str, Any]:
    """Where the numbers were taken (the load matters on a shared machine)."""
    import torch

    return {"host": platform.node(), "cpus": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "threads_per_rank": threads_per_rank, "backend": backend, "device": device,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def row(variant: str, implementation: str, step_s: float, *, peer: bool = False,
        state_bytes: int | None = None, bytes_sent: float | None = None,
        optimizer_s: float | None = None, **extra: Any) -> dict[str, Any]:
    """One row; ``ratio`` is filled in by ``document`` from the variant's peer row."""
    return {"variant": variant, "implementation": implementation, "peer": peer,
            "step_s": float(step_s), "ratio": None,
            "state_bytes": None if state_bytes is None else int(state_bytes),
            "bytes_sent": None if bytes_sent is None else float(bytes_sent),
            "optimizer_s": None if optimizer_s is None else float(optimizer_s), "extra": extra}


def ratio(r: dict[str, Any], peer: dict[str, Any]) -> float:
    """``r`` against its peer: the median over the repetitions of the per-repetition ratio when
    both rows carry their repetitions' times (``extra["times_s"]``, run back to back,
    alternating), else step_s / the peer's step_s. The paired median is what the benches
    report: on a shared machine the load drifts during a run, and a ratio of medians taken
    from different repetitions mixes the load of one with that of another."""
    a, b = r["extra"].get("times_s"), peer["extra"].get("times_s")
    if a and b and len(a) == len(b) and all(b):
        return float(statistics.median(x / y for x, y in zip(a, b)))
    return r["step_s"] / peer["step_s"]


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill each row's ``ratio`` against its variant's peer row (``ratio``)."""
    peers = {r["variant"]: r for r in rows if r["peer"]}
    for r in rows:
        base = peers.get(r["variant"])
        r["ratio"] = None if base is None else (1.0 if r is base else ratio(r, base))
    return rows


def document(bench: str, argv: list[str], rows: list[dict[str, Any]],
             settings: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
             mach: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = {"schema": SCHEMA, "version": VERSION, "bench": bench,
           "command": " ".join(["fived", "bench", bench, *argv]),
           "machine": mach if mach is not None else machine(),
           "settings": _plain(settings or {}), "rows": with_ratios(rows),
           "extra": _plain(extra or {})}
    validate(doc)
    return doc


_JSON_OUT: list[Any] = []  # the real stdout while ``json_stdout`` sends the rest to stderr


def emit(doc: dict[str, Any]) -> None:
    """Print the document as one JSON line on stdout (the last line a bench prints)."""
    import json

    emit_text(json.dumps(doc))


def emit_text(text: str) -> None:
    """``text`` (a JSON document) on stdout: the real one, under ``json_stdout``."""
    out = _JSON_OUT[-1] if _JSON_OUT else sys.stdout
    out.write(text + "\n")
    out.flush()


def json_stdout(main: Any) -> Any:
    """A bench's ``main(argv)`` under ``--json``: stdout carries the JSON document alone
    (``emit``), every other line -- progress, tables, the ranks' own prints -- goes to stderr,
    so ``fived bench NAME --json | python -m json.tool`` reads it. File descriptor 1 itself is
    pointed at stderr while the bench runs, so the spawned ranks' prints follow."""
    import contextlib
    import functools
    import os

    @functools.wraps(main)
    def run(argv: list[str] | None = None, *rest: Any, **kw: Any) -> Any:
        args = sys.argv[1:] if argv is None else argv
        if "--json" not in args or "-h" in args or "--help" in args:
            return main(argv, *rest, **kw)
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            on_fd1 = sys.stdout.fileno() == 1
        except (AttributeError, OSError, ValueError):  # a captured stdout (pytest): keep it
            on_fd1 = False
        real = os.fdopen(os.dup(saved), "w") if on_fd1 else sys.stdout
        _JSON_OUT.append(real)
        try:
            os.dup2(2, 1)
            with contextlib.redirect_stdout(sys.stderr):
                return main(argv, *rest, **kw)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved, 1)
            os.close(saved)
            _JSON_OUT.pop()
            if on_fd1:
                real.close()
    return run


def validate(doc: Any) -> None:
    """Raise ``ValueError`` unless ``doc`` is a ``fived.bench`` version-1 document."""
    if not isinstance(doc, dict):
        raise ValueError("document: not an object")
    for k, types in DOC_FIELDS.items():
        if k not in doc:
            raise ValueError(f"document: missing {k!r}")
        if not isinstance(doc[k], types):
            raise ValueError(f"document[{k!r}]: {type(doc[k]).__name__}")
    if doc["schema"] != SCHEMA or doc["version"] != VERSION:
        raise ValueError(f"document: schema {doc['schema']!r} v{doc['version']}, want "
                         f"{SCHEMA!r} v{VERSION}")
    for k in MACHINE_FIELDS:
        if k not in doc["machine"]:
            raise ValueError(f"machine: missing {k!r}")
    if not doc["rows"]:
        raise ValueError("rows: empty")
    peers: dict[str, int] = {}
    for i, r in enumerate(doc["rows"]):
        if not isinstance(r, dict):
            raise ValueError(f"rows[{i}]: not an object")
        for k, types in ROW_FIELDS.items():
            if k not in r:
                raise ValueError(f"rows[{i}]: missing {k!r}")
            v = r[k]
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                raise ValueError(f"rows[{i}][{k!r}]: {type(v).__name__}")
        if not r["step_s"] > 0:
            raise ValueError(f"rows[{i}]['step_s']: {r['step_s']} is not a positive time")
        peers[r["variant"]] = peers.get(r["variant"], 0) + int(r["peer"])
        if r["peer"] and r["ratio"] is not None and abs(r["ratio"] - 1.0) > 1e-12:
            raise ValueError(f"rows[{i}]: a peer row's ratio is {r['ratio']}, not 1")
    for v, n in peers.items():
        if n > 1:
            raise ValueError(f"variant {v!r}: {n} peer rows (at most one)")


def _plain(x: Any) -> Any:
    """JSON-safe copy (tuples to lists, other objects to str)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def comm_document(doc: dict[str, Any]) -> dict[str, Any]:
    """``fived bench comm``'s sweep (``fived.comm.bench.result_dict``, schema in docs/comm.md)
    as a ``fived.bench`` document: one row per (collective, size, implementation) — variant
    ``"all_reduce 16M"``, implementation ``backend`` (the peer) or ``ring``, step_s = one
    collective's median time, bytes_sent = what fived.comm's Traffic charged per call; each
    row's ``extra`` is the sweep's row (op, size_bytes, time_us, algbw_GBps, busbw_GBps ...)
    and the document's ``extra`` the rest of the sweep (world, fits, fits_by_impl, sizes ...)."""
    from ..comm.bench import format_size

    rows = [row(f"{r['op']} {format_size(r['size_bytes'])}", r["impl"], r["time_us"] * 1e-6,
                peer=r["impl"] == "backend", bytes_sent=r["recorded_bytes"], **r)
            for r in doc["rows"]]
    keys = ("host", "cpus", "loadavg_1m", "torch", "threads_per_rank", "backend", "device",
            "date")
    mach = {k: doc.get(k) for k in keys} | {"python": platform.python_version()}
    argv = doc.get("command", "fived bench comm").split()[3:]
    extra = {k: v for k, v in doc.items() if k not in ("rows", "command")}
    settings = {k: doc.get(k) for k in ("dtype", "iters", "warmup", "sizes", "ops", "impls")}
    return document("comm", argv, rows, settings=settings, extra=extra, mach=mach)
