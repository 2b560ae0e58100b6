"""`fived ledger --gpu this-machine` against `fived train`'s measured step time (issue 20).

The prediction and the run are measured back to back, three times, in the same time window (the
machine's load changes by the minute), and the medians compared: within 20 % for 1, 2 and 4
ranks of `small`. On the quiet machine it passed at 0.88, 1.01 and 1.11 (docs/ledger.md).
Marked slow: on the shared 2-core machine under load (load average ~25 while eight sessions
work) one run's step time swings by 2× from step to step, so the check means something only
on a quiet machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

# OpenMP's default (active) wait policy spins at every barrier: with two threads on two shared,
# loaded cores one thread is descheduled mid-matmul and a one-rank step of `small` takes 2-13 s
# instead of ~0.5 s (docs/ledger.md). Passive waiting removes that pathology from both the
# probe and the run, so the comparison measures the clock, not the spin.
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def _predicted(n: int) -> float:
    out = subprocess.run([sys.executable, "-m", "fived", "ledger", "--model", "small", "--gpu",
                          "this-machine", "--gpus", str(n), "--json"],
                         capture_output=True, text=True, timeout=600, check=True, env=ENV).stdout
    return json.loads(out)["time"]["step_seconds"]


def _measured(n: int, path) -> float:
    subprocess.run([sys.executable, "-m", "fived", "train", "--model", "small", "--dp", str(n),
                    "--steps", "8", "--metrics-out", str(path)],
                   capture_output=True, text=True, timeout=900, check=True, env=ENV)
    secs = [json.loads(line)["seconds"] for line in open(path) if '"seconds"' in line]
    return statistics.median(secs[1:])  # the first step warms up


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 4])
def test_this_machine_predicts_fived_train_within_20_percent(n, tmp_path):
    pred, meas = [], []
    for i in range(3):
        pred.append(_predicted(n))
        meas.append(_measured(n, tmp_path / f"m{i}.jsonl"))
    ratio = statistics.median(pred) / statistics.median(meas)
    assert 0.8 <= ratio <= 1.2, (n, pred, meas)
