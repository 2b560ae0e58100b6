"""Two nodes for real: two ``torchrun`` agents on this machine meet at a c10d rendezvous.

    torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT -m fived train --tp 2 --dp 2 ...

Global rank = node rank × 2 + local rank, and tp is innermost in the grid, so each tp pair lives
on one agent ("node") and dp crosses between them — the layout docs/multinode.md recommends.
The losses must equal a one-rank run's to 1e-5 relative. The recipe is in docs/multinode.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fived.config import ParallelConfig
from fived.ranks.grid import Grid
from fived.ranks.launch import free_port
from fived.testing import rel_diff

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
TRAIN = ["--steps", "3", "--global-batch", "8"]


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(path)]


def _run_all(cmds: list[list[str]], logs: list, timeout: float) -> list[int]:
    """Start every command at once (each in its own session), wait for all, kill all on timeout."""
    procs = [subprocess.Popen(c, stdout=f, stderr=subprocess.STDOUT, env=ENV,
                              start_new_session=True) for c, f in zip(cmds, logs)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs]


@pytest.mark.slow  # 13 s; its fast sibling: tests/test_torchrun.py (one agent, two ranks)
def test_two_torchrun_agents_match_one_rank(tmp_path):
    """Two torchrun agents (two "nodes") of two ranks each train tp2·dp2 and match one rank.

    Time: two torchrun agents and four rank interpreters are the subject (~14 s quiet, ~50 s
    on a loaded machine)."""
    par = ParallelConfig(tp=2, dp=2)
    grid = Grid.from_config(par)
    assert not grid.crosses_node(("tp",), 2) and grid.crosses_node(("dp",), 2)

    multi, one = tmp_path / "two-nodes.jsonl", tmp_path / "one-rank.jsonl"
    port = free_port()
    agents = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
               str(n), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "-m", "fived", "train", "--tp", "2", "--dp", "2", *TRAIN,
               "--metrics-out", str(multi)] for n in (0, 1)]
    single = [sys.executable, "-m", "fived", "train", "--dp", "1", "--nprocs", "1", *TRAIN,
              "--metrics-out", str(one)]
    logs = [open(tmp_path / f"{name}.log", "w") for name in ("node0", "node1", "one")]
    try:
        codes = _run_all([*agents, single], logs, timeout=240)
    finally:
        for f in logs:
            f.close()
    text = {n: (tmp_path / f"{n}.log").read_text() for n in ("node0", "node1", "one")}
    for (name, out), rc in zip(text.items(), codes):
        assert rc == 0, f"{name} exited {rc}:\n{out[-4000:]}"
        assert "terminate called" not in out, out[-4000:]
    got, want = _losses(multi), _losses(one)
    assert len(got) == len(want) == 3
    assert rel_diff(got, want) < 1e-5, (got, want)
    assert want[-1] < want[0]
    first = json.loads(open(multi).readline())
    assert first["run"]["parallel"]["tp"] == 2 and first["run"]["parallel"]["dp"] == 2
