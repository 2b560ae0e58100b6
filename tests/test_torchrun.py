"""Under torchrun: a run that trained exits 0 every time; a rank that fails ends the job at once.

Before ``fived.ranks.launch.run_torchrun`` about one run in three trained and then aborted at exit
("terminate called without an active exception"): a gloo worker thread released the last
all-gather's tensors while the interpreter was finalising (see ``launch.teardown``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from fived.ranks.launch import free_port

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def torchrun(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 ARGS`` on a free port (never the shared default 29500)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_torchrun_train_exits_cleanly_every_time():
    for attempt in range(3):
        t0 = time.monotonic()
        r = torchrun("-m", "fived", "train", "--dp", "2", "--steps", "2")
        out = r.stdout + r.stderr
        assert "terminate called" not in out, (attempt, out[-3000:])
        assert r.returncode == 0, (attempt, out[-3000:])
        assert "loss first → last" in r.stdout, out[-3000:]
        assert time.monotonic() - t0 < 180


def test_a_failing_rank_stops_the_job(tmp_path):
    """Rank 1 raises while rank 0 waits in a collective: the job fails fast with rank 1's
    traceback, not after the collective timeout."""
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

        run_torchrun(fn, (), collective_timeout=300)
    """))
    t0 = time.monotonic()
    r = torchrun(str(script), timeout=120)
    assert r.returncode != 0
    assert "rank 1 failed" in r.stderr and "planted failure on rank 1" in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60  # far below the 300 s collective timeout
