"""Every ``--help`` is fast: no command, benchmark or figure imports torch to print its help.

The check is exact, not timed: in one fresh interpreter, every ``fived CMD --help``, ``fived
bench NAME --help`` and ``fived figures NAME --help`` runs and torch is still not imported
afterwards (importing torch alone costs ~1 s, the whole of a slow help; a quiet help takes
~0.06 s: the interpreter, argparse and fived.config). One more fresh interpreter runs the entry
point as a user types it (``python -m fived --help``). Timing 108 interpreters instead was slow
and could only fail on a loaded machine.
"""

import os
import subprocess
import sys

from fived.cli.main import COMMANDS, main, modules

BOUND_S = 0.5


def helps() -> list[list[str]]:
    out = [[]] + [[c] for c in COMMANDS if c not in ("bench", "figures")]
    out += [["bench"]] + [["bench", n] for n in modules("fived.bench")]
    out += [["figures"]] + [["figures", n] for n in modules("fived.viz")]
    return [[*a, "--help"] for a in out]


def test_no_help_imports_torch():
    code = ("import sys, contextlib, io\n"
            "from fived.cli.main import main\n"
            f"for argv in {helps()!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        try:\n"
            "            rc = main(argv)\n"
            "        except SystemExit as e:\n"
            "            rc = e.code\n"
            "    assert rc in (0, None), (argv, rc)\n"
            "    assert 'usage' in out.getvalue(), argv\n"
            "    assert 'torch' not in sys.modules, ('imported torch:', argv)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_the_entry_point_prints_help():
    r = subprocess.run([sys.executable, "-m", "fived", "--help"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0 and "usage" in r.stdout and "train" in r.stdout, r.stderr


def test_helps_cover_every_command():
    names = {a[0] for a in helps() if len(a) > 1}
    assert names >= set(COMMANDS) and callable(main)
