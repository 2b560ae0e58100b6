"""The command line: a bad layout is one clean ConfigError; the JSONL of dp=2 equals dp=1."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def fived(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fived", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_bad_layout_is_one_clean_error():
    r = fived("train", "--tp", "3")
    assert r.returncode == 2
    assert r.stderr.count("ConfigError") == 1
    assert "Traceback" not in r.stderr + r.stdout
    assert "heads" in r.stderr


def test_unknown_model_is_clean():
    r = fived("train", "--model", "gpt-17")
    assert r.returncode == 2 and "unknown model preset" in r.stderr and "Traceback" not in r.stderr


def test_help_teaches():
    r = fived("train", "--help")
    assert r.returncode == 0 and "--global-batch" in r.stdout and "examples:" in r.stdout


def test_grid_prints_groups_and_warns():
    r = fived("grid", "--tp", "4", "--dp", "2", "--gpus-per-node", "2")
    assert r.returncode == 0
    assert "WARNING" in r.stdout and "tp groups cross a node boundary" in r.stdout


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def test_metrics_jsonl_dp2_equals_dp1(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r1 = fived("train", "--dp", "2", "--steps", "5", "--metrics-out", str(a))
    r2 = fived("train", "--dp", "1", "--steps", "5", "--metrics-out", str(b))
    assert r1.returncode == 0, r1.stderr
    assert r2.returncode == 0, r2.stderr
    la, lb = _losses(a), _losses(b)
    assert len(la) == len(lb) == 5
    assert max(abs(x - y) / y for x, y in zip(la, lb)) < 1e-5
    rec = json.loads(open(a).readline())
    for key in ("step", "loss", "tokens", "seconds", "memory", "traffic", "memory_per_rank"):
        assert key in rec
    assert set(rec["memory"]) >= {"params", "grads", "optimizer"}
    assert "measured" in r1.stdout  # the closing table


def _fails_on_rank_one(rank, world):
    import torch

    from fived.comm import ops
    from fived.comm.ops import Traffic
    from fived.config import ParallelConfig
    from fived.dist.grid import Grid

    g = Grid.from_config(ParallelConfig(dp=world), rank).connect(Traffic())
    if rank == 1:
        raise ValueError("boom on rank one")
    ops.all_reduce(torch.ones(4), g["dp"])  # rank 0 blocks here until it is killed


def test_failing_rank_is_reported_and_others_stopped():
    from fived.dist.launch import RankFailure
    from fived.testing import run_ranks

    with pytest.raises(RankFailure) as e:
        run_ranks(_fails_on_rank_one, 2, timeout=60)
    assert e.value.rank == 1 and "boom on rank one" in e.value.detail
