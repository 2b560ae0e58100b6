"""The argument parser every command uses: argparse's, with short errors that suggest.

A mistyped flag or choice (``--stpes``, ``--schedule zbv``, ``--zero 4``) is answered in at most
three lines — the error with its "did you mean …", one line of usage, and where the full list
is — instead of argparse's whole usage block (30 lines for ``fived train``). Exit code 2, as
argparse's own errors and ``ConfigError`` (``fived.cli.main``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from ..config import did_you_mean, suggest


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with errors of at most three lines that name the closest
    flag or choice."""

    def option_names(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        choices = list(action.choices)
        name = "/".join(action.option_strings) or ("command" if isinstance(
            action, argparse._SubParsersAction) else action.dest)
        shown = ", ".join(map(str, choices))
        near = did_you_mean(value, choices).removeprefix("; ")
        raise argparse.ArgumentError(
            None, f"{name} {value}: {near} (one of {shown})" if near
            else f"{name} {value}: not one of {shown}")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        argv = sys.argv[1:] if args is None else list(args)
        # an unknown flag first: argparse would name a required one it then misses
        # (`fived eval --form ck`: "--from is required", not "did you mean --from"); under a
        # subcommand (`fived data prepare`), with that subcommand's flags
        names = self.option_names()
        subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = next((t for t in argv if subs and t in subs[0].choices), None)
        if not subs or chosen is not None:
            if chosen is not None:
                names += subs[0].choices[chosen].option_names()
            for tok in argv:
                if tok == "--":
                    break
                word = tok.split("=", 1)[0]
                if word.startswith("--") and not any(n.startswith(word) for n in names):
                    self.error(self.unknown([tok], names))
        ns, rest = self.parse_known_args(argv, namespace)
        if rest:
            self.error(self.unknown(rest))
        return ns

    def unknown(self, rest: list[str], names: list[str] | None = None) -> str:
        """"unknown flag --stpes; did you mean --steps?" for the first unknown flag (or stray
        value)."""
        flags = [r for r in rest if r.startswith("-")]
        if not flags:
            return (f"unexpected argument(s) {' '.join(rest)} (a value without its flag, or one "
                    "too many)")
        word = flags[0].split("=", 1)[0]
        near = suggest(word, names if names is not None else self.option_names())
        more = f" (and {' '.join(flags[1:])})" if len(flags) > 1 else ""
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        return f"unknown flag {word}{more}{hint}"

    def error(self, message: str) -> NoReturn:
        import textwrap

        text = textwrap.wrap(f"{self.prog}: error: {message}", 80, subsequent_indent="  ",
                             break_long_words=False, break_on_hyphens=False)
        sys.stderr.write("\n".join(text) + "\n"
                         f"usage: {self.prog} [options]; `{self.prog} --help` lists them\n")
        raise SystemExit(2)
