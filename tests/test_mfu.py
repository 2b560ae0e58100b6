"""MFU's denominator cannot exceed the machine: every rank measures its matmul peak at the same
moment, on the threads it trains on, and the peak is the sum; a measured MFU above 100 % (the
machine got quieter after the measurement) is shown as "n/a (loaded)" with the reason."""

import json
import os
import re
import subprocess
import sys

from rich.console import Console

from fived.train.metrics import summary_table
from fived.train.trainer import MEASURE_PEAK, measure_world_peak, mfu_of, mfu_text


def test_mfu_text_refuses_more_than_the_machine():
    assert mfu_text(0.5) == "50.0%" and mfu_text(1.0) == "100.0%"
    assert mfu_text(1.01) == "n/a (loaded)"
    assert mfu_of(6.0, 10.0, 120.0) == 0.5 and mfu_of(6.0, 10.0, 0.0) == 0.0
    assert MEASURE_PEAK < 0


def test_summary_says_why_mfu_is_na():
    mem = {"params": 1, "grads": 1, "master": 0, "optimizer": 2}
    recs = [{"loss": 5.0 - i, "tokens_per_s": 100.0, "mfu": 1.7, "seconds": 0.1,
             "memory_per_rank": [mem], "traffic_per_rank": [{"bytes": {}}]} for i in range(3)]
    c = Console(record=True, width=120)
    c.print(summary_table(recs))
    text = c.export_text()
    assert "n/a (loaded)" in text and "measured 170% > 100%" in text


def _peak_rank(rank, world):
    import torch

    return measure_world_peak(world, torch.device("cpu"), seconds=0.1)


def test_world_peak_is_every_ranks_sum_measured_at_once():
    from fived.ranks.launch import run_local

    peaks = run_local(_peak_rank, 2, timeout=120)
    assert peaks[0] == peaks[1] > 0  # one sum, the same on every rank
    assert measure_world_peak(1, "cpu", seconds=0.05) > 0  # one rank: its own, no group


def test_train_dp2_mfu_is_at_most_100_percent(tmp_path):
    """OMP_NUM_THREADS=1 here (tests/conftest.py): one process measuring for both ranks used one
    thread while the two ranks train on two, and printed twice the MFU."""
    out = tmp_path / "m.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "fived", "train", "--dp", "2", "--steps", "3",
                        "--metrics-out", str(out)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 rank(s) measured at once, summed" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "MFU (median)" in x)
    m = re.search(r"([\d.]+)%", line)
    assert "n/a (loaded)" in line or float(m.group(1)) <= 100.0, line
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(rec["mfu"] > 0 for rec in recs)
