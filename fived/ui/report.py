"""Formatters and tables shared by the commands: numbers people read, tables that fit.

Every table is built by ``table``: a light box, one space between columns, numbers that never
wrap. The commands keep their default tables to the columns that fit an 80-column terminal;
``--wide`` adds the rest and ``--json`` prints everything as one document.
"""

from __future__ import annotations

import json
import sys
from typing import Any

_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SUFFIX10 = {"K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12}


def parse_count(text: str, binary: bool = True) -> int:
    """'4M' -> 4·2^20 (binary, for batch sizes) or 4e6 (decimal, for token budgets); '1e12'."""
    t = str(text).strip().upper()
    table_ = _SUFFIX if binary else _SUFFIX10
    if t and t[-1] in table_:
        return int(float(t[:-1]) * table_[t[-1]])
    return int(float(t))


def fmt_b(n: float) -> str:
    from ..ledger.memory import fmt_bytes

    return fmt_bytes(n)


WIDTH = 80  # every plain line a command prints fits this (tables: ``table``; --wide is wider)


def header(parts: list[str], width: int = WIDTH, sep: str = " · ") -> str:
    """``parts`` joined by `` · `` in lines of at most ``width`` columns, broken only between
    parts (never inside one); the lines after the first are indented by two spaces."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part if not lines else "  " + part)
    return "\n".join(lines)


def fold(text: str, width: int = WIDTH, indent: str = "    ") -> str:
    """One paragraph in lines of at most ``width`` columns, broken between words only (a word
    longer than the line stays whole); the lines after the first are indented."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent,
                                   break_long_words=False, break_on_hyphens=False)) or text


def break_after(text: str, width: int, sep: str = "·") -> str:
    """``text`` in lines of at most ``width`` columns, broken just after a ``sep`` (a layout
    name such as tp8·pp16·dp64·v4·zero2 wraps between its parts, never inside one)."""
    parts = text.split(sep)
    lines = [""]
    for i, part in enumerate(parts):
        piece = part + (sep if i < len(parts) - 1 else "")
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(lines)


def shell(cmd: str, width: int = WIDTH, indent: str = "  ") -> str:
    """A command line in lines of at most ``width`` columns, continued with `` \\`` between a
    flag and the next (a flag keeps its value), so it still pastes into a shell."""
    words, groups = cmd.split(), []
    for w in words:
        if groups and not w.startswith("-") and groups[-1].startswith("-") \
                and " " not in groups[-1]:
            groups[-1] += " " + w
        else:
            groups.append(w)
    lines = [indent]
    for g in groups:
        if lines[-1].strip() and len(lines[-1]) + 1 + len(g) + 2 > width:
            lines.append(indent + "    ")
        lines[-1] += ("" if not lines[-1].strip() else " ") + g
    return " \\\n".join(lines)


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


def console(wide: bool = False):
    """A rich console on stdout. Its width: the terminal's, or $COLUMNS, or 80; ``wide``
    (--wide): at least 200, so the tables keep their natural width (wider than the terminal)."""
    from rich.console import Console

    con = Console(highlight=False)
    if wide and con.width < 200:
        con = Console(highlight=False, width=200)
    return con


def ranks(members: list[int]) -> str:
    """A group's ranks, compact: "0,1,2,3", or "0,4,..,28" for a longer even stride."""
    if len(members) > 4:
        step = members[1] - members[0]
        if all(b - a == step for a, b in zip(members, members[1:])):
            return f"{members[0]},{members[1]},..,{members[-1]}"
    return ",".join(map(str, members))


def table(title: str | None, columns: list[tuple[str, str]], wrap: tuple[str, ...] = ()):
    """A compact rich table. ``columns``: (header, "l" or "r"); the columns named in ``wrap``
    may wrap their text over lines (words, then characters), the others never wrap."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, header_style="bold")
    t.fived_title = title  # printed by ``show`` on its own line: a narrow table cannot wrap it
    for name, just in columns:
        w = name in wrap
        t.add_column(name, justify="left" if just == "l" else "right", no_wrap=not w,
                     overflow="fold" if w else "ellipsis", min_width=None if w else len(name))
    return t


def show(con, t) -> None:
    """Print a ``table``: its title as a line of its own, then the table."""
    if getattr(t, "fived_title", None):
        con.print(f"[bold]{t.fived_title}[/]")
    con.print(t)


def bullets(con, lines: list[str]) -> None:
    """A bulleted list whose lines wrap under their own text, not under the bullet."""
    from rich.table import Table

    g = Table.grid(padding=(0, 1))
    g.add_column(no_wrap=True)
    g.add_column(overflow="fold")
    for line in lines:
        g.add_row("  •", line)
    con.print(g)


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()
