"""Forward-only evaluation (docs/eval.md): ``Trainer.evaluate`` under ``torch.no_grad`` equals
the old path (each validation batch run as a training micro-step with a zero loss scale, the
gradients discarded; kept here only, as ``old_evaluate``) to 1e-6 on every layout, touches no
gradient and no MoE statistic; ``fived eval`` loads a checkpoint at any layout and reports the
loss a training run's --eval-every gave for the same weights; bad input exits 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fived.config import ParallelConfig, preset, validate
from fived.data.meta import model_for_data
from fived.data.prepare import Options, prepare
from fived.testing import micro_step_evaluate as old_evaluate
from fived.testing import run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import run_cli  # noqa: E402,I001

TOL = 1e-6
ROOT = Path(__file__).resolve().parents[1]


def _prepare(d: Path, files: int = 12, val: float = 0.25, bpe: int = 0) -> str:
    (d / "in").mkdir(parents=True)
    for i in range(files):
        (d / "in" / f"{i:02d}.txt").write_text(f"# file {i}\n" + "".join(
            f"def f{k}(x):\n    return x * {i + k}\n" for k in range(12)))
    opts = Options((str(d / "in"),), str(d / "out"), val_fraction=val, workers=1)
    if bpe:
        opts = replace(opts, train_bpe=bpe)
    prepare(opts, lambda s: None)
    return str(d / "out")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return _prepare(tmp_path_factory.mktemp("eval"))


# ------------------------------------------------------------------ parity with the old path
def _grad_state(t):
    """Every gradient a rank holds: the engine's buffers and each parameter's .grad."""
    import torch

    bufs = []
    for b in t.engine.buckets:
        g = t.engine.grad_state(b)
        bufs.append(None if g is None else g.detach().clone())
    grads = [None if p.grad is None else p.grad.detach().clone()
             for p in t.stage.parameters()]
    return bufs, grads, torch


def _same(a, b) -> bool:
    import torch

    return all((x is None and y is None) or (x is not None and y is not None
                                             and x.shape == y.shape and torch.equal(x, y))
               for x, y in zip(a, b))


def _moe_stats(t):
    from fived.model.moe import moe_layers

    return [(m.stats.tokens_per_expert.clone(), m.stats.dropped, m.stats.balance_sum, m.stats.z_sum,
             m.stats.forwards)
            for m in moe_layers(t.stage)]


def _parity_rank(rank: int, world: int, runs: list) -> list[dict]:
    """Per run: one training step, then the new evaluation (grads and MoE statistics checked
    untouched), then the old path."""
    import torch

    from fived.train.trainer import Trainer

    out = []
    for model, par, train in runs:
        torch.manual_seed(train.seed)
        t = Trainer(model, par, train, rank, world)
        t.step(0)
        bufs, grads, _ = _grad_state(t)
        stats = _moe_stats(t)
        new = t.evaluate()["val_loss"]
        bufs2, grads2, _ = _grad_state(t)
        stats2 = _moe_stats(t)
        untouched = _same(bufs, bufs2) and _same(grads, grads2) and len(bufs) > 0
        stats_kept = all(torch.equal(a[0], b[0]) and a[1:] == b[1:]
                         for a, b in zip(stats, stats2))
        old = old_evaluate(t)
        again = t.evaluate()["val_loss"]  # after the old path's zero_grad: the same again
        t.close()
        out.append({"new": new, "old": old, "again": again, "untouched": untouched,
                    "stats_kept": stats_kept, "moe_layers": len(stats)})
    return out


def _cfg(data_dir, name="tiny"):
    model = model_for_data(preset(name), data_dir)
    train = small_train(steps=2, data=data_dir, eval_every=1, eval_batches=2)
    return model, train


def _check(res, ref, what):
    for r in res:
        assert abs(r["new"] - r["old"]) / r["old"] < TOL, (what, r)
        assert abs(r["again"] - r["new"]) / r["new"] < TOL, (what, r)
        assert abs(r["new"] - ref) / ref < 1e-5, (what, "vs one rank", r, ref)
        assert r["untouched"], (what, "evaluation changed a gradient")
        assert r["stats_kept"], (what, "evaluation counted MoE routing statistics")


def test_one_rank_no_grad_eval_equals_the_training_micro_step_path(data_dir):
    model, train = _cfg(data_dir)
    r = _parity_rank(0, 1, [(model, ParallelConfig(), train)])[0]
    _check([r], r["old"], "1 rank")


LAYOUTS = [  # every 2-rank layout of the default suite, one spawn (V layout: a local hand-off)
    ("tiny", ParallelConfig(dp=2)),
    ("tiny", ParallelConfig(tp=2)),
    ("tiny", ParallelConfig(pp=2, micro_batches=2, schedule="1f1b")),
    ("tiny", ParallelConfig(pp=2, micro_batches=2, schedule="gpipe", zero=3, dp=1)),
    ("tiny", ParallelConfig(dp=2, zero=3)),
    ("tiny", ParallelConfig(cp=2)),
    ("tiny-moe", ParallelConfig(ep=2)),
    ("tiny", ParallelConfig(pp=2, micro_batches=4, schedule="interleaved", virtual_stages=2)),
    ("tiny", ParallelConfig(pp=2, micro_batches=4, schedule="zb-v", virtual_stages=2,
                            recompute="full")),
    ("tiny", ParallelConfig(tp=2, sequence_parallel=True, zero=2, recompute="selective")),
]


@pytest.mark.slow
def test_two_rank_layouts_no_grad_eval_equals_the_old_path_and_one_rank(data_dir):
    runs, refs = [], []
    for name, par in LAYOUTS:
        model, train = _cfg(data_dir, name)
        validate(model, par, train, 2)
        runs.append((model, par, train))
        refs.append(_parity_rank(0, 1, [(model, ParallelConfig(), train)])[0]["new"])
    per_rank = run_ranks(_parity_rank, 2, runs, timeout=600)
    for i, (name, par) in enumerate(LAYOUTS):
        _check([per_rank[r][i] for r in range(2)], refs[i], f"{name} {par.describe()}")
    moe = [i for i, (name, _) in enumerate(LAYOUTS) if name == "tiny-moe"]
    assert moe and all(per_rank[r][i]["moe_layers"] > 0 for r in range(2) for i in moe)


def test_forward_only_schedule_keeps_the_forward_half_and_checks():
    from fived import schedules

    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2),
                    ("dualpipe-v", 2)):
        sched = schedules.build(name, 2, 4, v)
        fwd = schedules.forward_only(sched)
        schedules.check(fwd)
        for acts, full in zip(fwd.ranks, sched.ranks):
            assert acts == [a for a in full if a.kind in ("F", "SEND_F", "RECV_F")]
    bad = schedules.forward_only(schedules.build("1f1b", 2, 2))
    bad.ranks[1] = bad.ranks[1][:-2]  # drop a micro-batch's receive and forward
    with pytest.raises(schedules.ScheduleError):
        schedules.check(bad)


# ------------------------------------------------------------------ fived eval
def fived(*args, check=False):
    """``fived ARGS`` in this process (its ranks from the suite's pool)."""
    r = run_cli(*args)
    if check:
        assert r.returncode == 0, (r.stdout, r.stderr)
    return r


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A 3-step dp2 run with --eval-every and --save-dir: the checkpoint and its val losses."""
    d = tmp_path_factory.mktemp("run")
    metrics = d / "m.jsonl"
    fived("train", "--data", data_dir, "--dp", "2", "--steps", "3", "--global-batch", "8",
          "--eval-every", "3", "--eval-batches", "2", "--save-dir", str(d / "ck"),
          "--metrics-out", str(metrics), check=True)
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    return str(d / "ck"), [r["val_loss"] for r in recs if "val_loss" in r]


def test_fived_eval_equals_the_training_runs_last_val_loss_at_another_layout(trained,
                                                                            data_dir):
    ck, vals = trained
    r = fived("eval", "--from", ck, "--data", data_dir, "--tp", "2", "--batches", "2",
              "--json", check=True)
    doc = json.loads(r.stdout)  # stdout is one JSON document, nothing else
    assert doc["step"] == 3 and doc["batches"] == 2 and doc["split"] == "val"
    assert abs(doc["loss"] - vals[-1]) / vals[-1] < TOL, (doc, vals)
    assert abs(doc["ppl"] - math.exp(doc["loss"])) < 1e-9 * doc["ppl"]
    assert doc["tokens"] == 2 * 8 * preset("tiny").seq_len and doc["seconds"] > 0
    assert doc["layout"] == ParallelConfig(tp=2).describe()
    # the table, at one rank, from the step-N directory itself, as a user types it (the rank
    # prints the progress lines: a forked rank's stdout is not this process's)
    r = subprocess.run([sys.executable, "-m", "fived", "eval", "--from", doc["checkpoint"],
                        "--data", data_dir, "--batches", "2"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "batch 1/2" in r.stdout and "batch 2/2" in r.stdout, r.stdout
    lines = [x for x in r.stdout.splitlines() if not x.startswith("fived eval:")]  # its paths
    assert all(len(line) <= 80 for line in lines), r.stdout
    assert f"{vals[-1]:.4f}" in r.stdout, (r.stdout, vals)


def test_fived_eval_help_teaches():
    """Its speed (no torch imported) is tests/test_help_speed.py's exact check."""
    r = fived("eval", "--help", check=True)
    assert "--from" in r.stdout and "--batches" in r.stdout and "--tp" in r.stdout


def test_fived_eval_bad_input_exits_2_naming_the_flag(trained, data_dir, tmp_path):
    ck, _ = trained
    other = _prepare(tmp_path / "bpe", files=12, bpe=300)  # another tokenizer
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--from", str(tmp_path / "nope"), "--data", data_dir], "--from"),
        (["--from", str(empty), "--data", data_dir], "--from"),
        (["--from", ck, "--data", other], "--data"),
        (["--from", ck, "--data", data_dir, "--batches", "0"], "--batches"),
        (["--from", ck, "--data", data_dir, "--split", "test"], "--split"),
        (["--from", ck], "--data"),
        (["--from", ck, "--data", str(tmp_path / "nodata")], "--data"),
        (["--from", ck, "--data", data_dir, "--tp", "3"], "--tp can be 1, 2 or 4"),  # validate
    ]
    for args, flag in cases:
        r = run_cli("eval", *args, no_rank=True)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and flag in r.stderr, (args, r.stderr)
        assert "rank" not in r.stdout, (args, r.stdout)  # refused before any rank started
