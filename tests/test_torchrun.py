"""Under torchrun: a run that trained exits 0; a rank that fails ends the job at once.

Before ``fived.ranks.launch.run_torchrun`` about one run in three trained and then aborted at exit
("terminate called without an active exception", SIGABRT; torchrun then fails the job). The
cause (a core dump's backtrace): a gloo worker thread (``ProcessGroupGloo::runLoop``) destroys
each finished collective's work a moment after ``wait()`` returned; when the work held the last
reference to a tensor whose Python object was already gone, the worker takes the GIL to free it,
and if the interpreter is finalising by then ``take_gil`` ends the thread with ``pthread_exit``,
whose unwinding meets a ``noexcept`` frame: ``std::terminate``. ``run_torchrun`` waits for every
rank and ``launch.teardown`` destroys the groups, which joins their worker threads before Python
exits. ``test_run_torchrun_joins_the_gloo_workers`` checks that directly (no race to win): the
threads are gone when ``run_torchrun`` returns.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from fived.ranks.launch import free_port

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def torchrun(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 ARGS`` on a free port (never the shared default 29500)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_torchrun_train_exits_cleanly():
    r = torchrun("-m", "fived", "train", "--dp", "2", "--steps", "2")
    out = r.stdout + r.stderr
    assert "terminate called" not in out, out[-3000:]
    assert r.returncode == 0, out[-3000:]
    assert "loss first → last" in r.stdout, out[-3000:]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names from /proc (Linux)")
def test_run_torchrun_joins_the_gloo_workers(tmp_path):
    """The abort's precondition, removed: ``fn`` all-gathers into tensors that die with it (the
    pattern that aborted at exit in about half the runs of a bare script), and when
    ``run_torchrun`` returns no gloo worker thread of this process is alive."""
    script = tmp_path / "workers.py"
    script.write_text(textwrap.dedent("""
        import os
        import torch
        import torch.distributed as dist
        from fived.ranks.launch import run_torchrun

        def workers():
            return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop"
                       for t in os.listdir("/proc/self/task"))

        def fn(rank, world):
            for _ in range(20):
                out = torch.empty(2 << 16)
                dist.all_gather_into_tensor(out, torch.full((1 << 16,), float(rank)))
            return workers()

        during = run_torchrun(fn, ())
        print(f"rank {os.environ['RANK']}: {during} gloo workers during, {workers()} after",
              flush=True)
    """))
    r = torchrun(str(script), timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "terminate called" not in out, out[-3000:]
    # the two ranks share torchrun's stdout: their lines may run together, so match, not split
    found = sorted(re.findall(r"rank (\d+): (\d+) gloo workers during, (\d+) after", r.stdout))
    assert found == [(str(k), "2", "0") for k in range(2)], out[-3000:]


def test_a_failing_rank_stops_the_job(tmp_path):
    """Rank 1 raises while rank 0 waits in a collective: the job fails with rank 1's traceback,
    and at once: the collective timeout is an hour, so only a failing rank that ends the job
    lets torchrun return inside the subprocess timeout (no clock read here)."""
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        from fived.ranks.launch import run_torchrun

        def fn(rank, world):
            if rank == 1:
                raise ValueError("planted failure on rank 1")
            dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that never comes
            return rank

        run_torchrun(fn, (), collective_timeout=3600)
    """))
    r = torchrun(str(script), timeout=120)  # raises TimeoutExpired if the job waits
    assert r.returncode != 0
    assert "rank 1 failed" in r.stderr and "planted failure on rank 1" in r.stderr, r.stderr[-3000:]
