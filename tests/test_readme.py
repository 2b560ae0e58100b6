"""The README runs (issue 45): every ``fived …`` command of README.md is extracted and run, and
every ``fived …`` line of the docs' shell blocks is checked against its command's flags, so a
README or a page that drifts from the command line fails CI.

* A README command with no placeholder (no ``DIR``, ``N``, ``[...]``, ``a|b``, ``...``) runs in
  this process, in order, in a temporary folder (the worked example's ``generate`` and
  ``export`` read the checkpoint its ``train`` wrote): exit 0, no traceback, and none of
  torch's ProcessGroup warnings on the real stderr. ``SMALLER`` lists the only changes made
  to them (fewer steps and tokens, one dry-run rank of the same layout, a small loader
  benchmark); such a command first runs as written with ``--print-config`` where it takes
  one (train, ledger, plan: the configuration resolved and validated as written).
* A command with placeholders, and every ``fived`` line of a ```sh block in docs/*.md: the
  subcommand exists and each ``--flag`` is one its ``--help`` lists.

"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import run_cli  # noqa: E402,I001

ROOT = Path(__file__).resolve().parent.parent

# what the test changes in a README command, and why: the doc's own numbers are for a person
# (100 steps, 40 tokens, five ranks of the 405B layout); the flags and the layout stay
SMALLER = {
    "--steps 100": "--steps 4",
    "--save-every 50": "--save-every 2",
    "--max-new-tokens 40": "--max-new-tokens 4",
    "--global-batch 1024 --micro-batches 16 --ranks distinct":
        "--global-batch 64 --micro-batches 1 --ranks 0",
    "fived bench data": "fived bench data --model tiny --corpus-mb 0.25 --batches 20 --steps 1 "
                        "--min-ratio 0.001",
}
# a file a README command reads, made first by the command that writes it
BEFORE = {
    "fived ledger --check run.jsonl": "fived train --nprocs 1 --steps 2 --global-batch 2 "
                                      "--metrics-out run.jsonl",
}
PLACEHOLDER = re.compile(r"\[|\.\.\.|\||\b[A-Z][A-Z_]*\b|\$")
SUBCOMMANDS = ("bench", "figures", "data", "checkpoint")


def commands(text: str, table: bool, mentions: bool = True) -> list[str]:
    """The ``fived …`` commands of a Markdown text: each line of a ```sh block that starts with
    ``fived`` (or ``$ fived``), continuation lines joined, comments cut; with ``table``, also
    the backticked ``fived …`` of the first cell of table rows (``\\|`` is a ``|``) — of the
    tables whose first column is "command", and with ``mentions`` of the others too (a name in
    a sentence, "`fived bench zero --hsdp`": its flags are checked, it is not run)."""
    out, block, cont, lines = [], False, "", []
    commands_table = False
    for line in text.splitlines():
        if table and line.startswith("|") and not line.startswith("|-"):
            first = line.split("|")[1].strip()
            if first in ("command", "piece", "what") or first.startswith("---"):
                commands_table = first == "command"
                continue
        if line.startswith("```"):
            if block:  # a block with "$ " prompts: only those lines are commands (the rest
                prompted = any(x.startswith("$ ") for x in lines)  # is their output)
                for x in lines:
                    if prompted and not x.startswith("$ "):
                        continue
                    x = x.removeprefix("$ ")
                    words = x.split()
                    # "fived DDP 0.97× ...", "fived train: ConfigError": prose and output
                    if len(words) > 1 and words[0] == "fived" and re.fullmatch(r"[a-z]+",
                                                                               words[1]):
                        out.append(x.split("  #")[0].split(" # ")[0].strip())
            block = not block and line.strip() in ("```sh", "```bash", "```")
            lines = []
            continue
        if block:
            line = cont + line.strip()
            cont = ""
            if line.endswith("\\"):
                cont = line[:-1] + " "
                continue
            lines.append(line)
        elif table and line.startswith("|") and (commands_table or mentions):
            first = line.replace("\\|", "\0").split("|")[1].replace("\0", "|")
            out += [c for c in re.findall(r"`(fived [^`]+)`", first)]
    return out


def test_the_readme_has_its_commands():
    cmds = commands((ROOT / "README.md").read_text(), table=True)
    assert len(cmds) >= 20, cmds
    assert any(c.startswith("fived train --dry-run") for c in cmds)


def _help(words: list[str]) -> str:
    r = run_cli(*words, "--help")
    assert r.returncode == 0, (words, r.stderr)
    return r.stdout


def check_flags(cmd: str) -> None:
    """The subcommand of a template exists and every --flag it names is in its --help."""
    words = cmd.replace("[", " ").replace("]", " ").split()[1:]
    head = [words[0]]
    if words[0] in SUBCOMMANDS and len(words) > 1 and not words[1].startswith("-"):
        names = words[1].split("|")
        known = _help([words[0]])
        for n in names:
            if not PLACEHOLDER.fullmatch(n) and n != "NAME":
                assert n in known, (cmd, n)
        real = [n for n in names if not PLACEHOLDER.fullmatch(n)]
        if real:
            head.append(real[0])  # NAME|all: the flags of `all`, the parts share them
    text = _help(head)
    for w in words:
        if w.startswith("--"):
            flag = w.split("=")[0].rstrip(",.")
            assert re.search(re.escape(flag) + r"\b", text), (cmd, flag)


def test_every_docs_command_names_real_flags():
    """Every ``fived`` line of README.md and docs/*.md: its flags exist (drift fails here)."""
    seen = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for cmd in commands(page.read_text(), table=page.name == "README.md"):
            check_flags(cmd)
            seen += 1
    assert seen >= 60, seen


def smaller(cmd: str) -> str:
    for a, b in SMALLER.items():
        cmd = cmd.replace(a, b)
    return cmd


def test_every_readme_command_runs(tmp_path, monkeypatch, capfd):
    """The README's commands without placeholders, as written (``SMALLER`` aside), in order.
    Mutations: the README's old dry-run line (no --global-batch) exits 2 here; without
    ``fived.train.dryrun.quiet_destroy`` torch's "No backend of type 0" warning reaches fd 2.

    Time: about a minute (70 s on 2 loaded cores): a 4-rank training, generation at tp 2, an
    export, the planner for llama3-70b on 64 GPUs, one dry-run rank of the 405B layout, the
    loader benchmark."""
    monkeypatch.chdir(tmp_path)
    ran = []
    for cmd in commands((ROOT / "README.md").read_text(), table=True, mentions=False):
        if PLACEHOLDER.search(cmd.removeprefix("fived ")):
            continue
        small = smaller(cmd)
        argv = shlex.split(small)[1:]
        if small != cmd and argv[0] in ("train", "ledger", "plan"):
            r = run_cli(*shlex.split(cmd)[1:], "--print-config")
            assert r.returncode == 0, (cmd, r.stderr)
        if cmd in BEFORE:
            r = run_cli(*shlex.split(BEFORE[cmd])[1:])
            assert r.returncode == 0, (BEFORE[cmd], r.stderr[-3000:])
        r = run_cli(*argv)
        assert r.returncode == 0, (small, r.stdout[-3000:], r.stderr[-3000:])
        assert "Traceback" not in r.stdout + r.stderr, small
        ran.append(small)
    assert len(ran) >= 8, ran
    assert any("--dry-run" in c for c in ran) and any("export" in c for c in ran), ran
    fd = capfd.readouterr()
    assert "No backend of type" not in fd.err + fd.out, fd.err[-3000:]
