"""``fived plan`` answers in seconds and says so as it goes (issue 45, item 5).

The bound is on the plan's CPU time (user + system, its own process): on a machine shared
with other jobs the wall clock runs slower by the load, the CPU time does not; on an idle
machine they agree. Peak memory is the process's maximum resident set.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest


def _plan(*argv: str) -> tuple[subprocess.CompletedProcess, float, float, float]:
    """Run ``fived plan`` in its own process: (result, CPU seconds, wall seconds, peak MB) —
    the child's own rusage (``os.wait4``), not the largest of every child this test process
    ever waited for."""
    t = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-m", "fived", "plan", *argv], stdout=out,
                             stderr=err, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        r = subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())
    wall = time.monotonic() - t
    return r, usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss / 1024


def test_small_plan_is_quick_and_reports_progress_off_a_terminal():
    """The fast sibling of the slow test: a MoE plan on 32 GPUs (thousands of layouts), with
    progress lines on stderr though stderr is a pipe, and the winner's ledger command."""
    r, cpu, wall, _ = _plan("--model", "mixtral-8x7b", "--gpus", "32", "--top", "3")
    assert r.returncode == 0, r.stderr
    assert "fived plan: searching:" in r.stderr and "layouts costed (100%)" in r.stderr
    assert "layouts enumerated" in r.stderr
    assert "timed in full" in r.stdout and "fived ledger --model mixtral-8x7b" in r.stdout
    assert cpu < 10, f"{cpu:.1f} s of CPU ({wall:.1f} s wall)"


@pytest.mark.slow
@pytest.mark.parametrize("model,gpus", [("qwen3-235b-a22b", 256), ("llama3-405b", 8192)])
def test_big_plans_answer_in_seconds(model, gpus):
    """Time: the two plans of issue 45 (before: 5 min 58 s and 4.56 GB for the first)."""
    r, cpu, wall, rss = _plan("--model", model, "--gpus", str(gpus))
    assert r.returncode == 0, r.stderr
    assert "fived plan: searching:" in r.stderr
    assert cpu <= 30, f"{cpu:.1f} s of CPU ({wall:.1f} s wall)"
    assert rss <= 500, f"{rss:.0f} MB peak"
