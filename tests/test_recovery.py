"""Runs that recover on their own (fived.train.resilience, docs/checkpoints.md "Runs that
recover"): --resume auto, torchrun restarts after kill -9 (two fixed draws of where; a fresh
draw under ``-m slow``), preemption by SIGTERM, non-finite steps skipped and --max-bad-steps, a
full disk during a save, the bounded history. No assertion reads a clock."""

from __future__ import annotations

import errno
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from fived.config import PRESETS, ParallelConfig
from fived.ranks.launch import free_port
from fived.testing import run_ranks, small_train

DENSE = PRESETS["tiny"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def fived(*args: str, timeout: float = 300, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "fived", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)


def losses_of(path) -> dict[int, float]:
    """step -> loss of a --metrics-out file; every step must appear once."""
    out: dict[int, float] = {}
    for line in open(path):
        rec = json.loads(line)
        assert rec["step"] not in out, f"step {rec['step']} twice in {path}"
        out[rec["step"]] = rec["loss"]
    return out


# ------------------------------------------------------------------ bad input
def test_resume_auto_needs_save_dir_and_explicit_resume_must_exist(tmp_path):
    r = fived("train", "--resume", "auto", "--steps", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert "--resume auto" in r.stderr and "--save-dir" in r.stderr
    r = fived("train", "--resume", str(tmp_path / "nothing"), "--steps", "2")
    assert r.returncode == 2 and "no such directory" in " ".join(r.stderr.split())
    assert "Traceback" not in r.stderr
    r = fived("train", "--preempt-signals", "TERM,KILL", "--steps", "2")
    assert r.returncode == 2 and "--preempt-signals" in r.stderr and "KILL" in r.stderr
    assert not list(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------ torchrun restarts
RESTART_STEPS = 12


def _restart_plan(seed: int) -> tuple[int, int, int]:
    """(victim rank, first death, second death) drawn from ``seed``."""
    rng = random.Random(seed)
    first = rng.randrange(2, 6)  # step-000002 exists by then (a death at step 1 restarts fresh)
    second = rng.randrange(first + 1, RESTART_STEPS - 1)  # after the restart resumed at <= first
    return rng.randrange(2), first, second


def _torchrun_train(out: str, save: str, die_at: str = "") -> subprocess.CompletedProcess:
    """The job under torchrun; ``die_at`` ("R:S0,S1"): ``tests/die_at.py`` installs the hook
    that kills rank R at step S_k of the k-th attempt."""
    entry = [os.path.join(os.path.dirname(__file__), "die_at.py"), die_at] if die_at else [
        "-m", "fived"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *entry, "train", "--dp", "2",
           "--steps", str(RESTART_STEPS), "--global-batch", "4", "--save-every", "2",
           "--save-dir", save, "--resume", "auto", "--metrics-out", out, "--timeout", "30"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=ENV)


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory) -> dict[int, float]:
    """The losses of the same torchrun command line never interrupted (shared by the seeds)."""
    d = tmp_path_factory.mktemp("straight")
    r = _torchrun_train(str(d / "ref.jsonl"), str(d / "ref"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return losses_of(d / "ref.jsonl")


def _two_kills(tmp_path, seed: int, straight: dict[int, float]) -> None:
    victim, first, second = _restart_plan(seed)
    print(f"seed {seed}: rank {victim} dies at step {first}, then at step {second}")
    r = _torchrun_train(str(tmp_path / "k.jsonl"), str(tmp_path / "ck"),
                        f"{victim}:{first},{second}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert out.count("--resume auto: resuming from") == 2, out[-4000:]
    assert "starting fresh" in out
    # each restart resumed from the newest checkpoint before its death (--save-every 2)
    for at in (first, second):
        assert f"resuming from {tmp_path / 'ck' / f'step-{at - at % 2:06d}'}" in out, out[-4000:]
    got = losses_of(tmp_path / "k.jsonl")
    assert sorted(got) == list(range(RESTART_STEPS)) and got == straight, (seed, got, straight)


# two fixed draws: rank 0 dies at the first checkpoint's step (2) and again two steps on;
# rank 1 dies mid-interval (4, then 10: a resume from step 4, then from step 10)
@pytest.mark.parametrize("seed", [2, pytest.param(5, marks=pytest.mark.slow)],  # one by default
                         ids=lambda s: "rank{}-at-{}-{}".format(*_restart_plan(s)))
def test_torchrun_restarts_after_two_kills_end_with_the_straight_losses(tmp_path, seed,
                                                                        straight_losses):
    """A rank dies by SIGKILL, twice in one torchrun --max-restarts 2 job; the same command
    line restarts from the newest checkpoint each time; the losses of every step equal (bit for
    bit: the same layout) those of a run that never stopped.

    Time: three torchrun attempts of two ranks (≈ 12 s on 2 cores), and for the first seed the
    straight run the seeds share (≈ 8 s)."""
    _two_kills(tmp_path, seed, straight_losses)


@pytest.mark.slow
def test_torchrun_restarts_at_random_steps(tmp_path, straight_losses):
    """The same with a fresh draw each run (FIVED_RECOVERY_SEED=<seed> replays one)."""
    seed = int(os.environ.get("FIVED_RECOVERY_SEED") or random.randrange(1 << 30))
    _two_kills(tmp_path, seed, straight_losses)


# ------------------------------------------------------------------ preemption
def test_sigterm_saves_at_the_next_step_and_resumes_to_identical_losses(tmp_path):
    """SIGTERM to `fived train` mid-run: every rank saves after the same step, at or after the
    steps done when the signal was sent, and the run exits with 75 (that the save comes after
    the step in flight, not later, is checked exactly in-process: ``_sigterm_rank1`` below); the
    same command line finishes the run with the losses of a run that never stopped.

    Time: three `fived train` processes of 40 steps (the signal is the subject, so real
    processes; ~20 s quiet)."""
    steps = 40
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "fived", "train", "--nprocs", "2", "--steps", str(steps),
           "--global-batch", "4", "--save-dir", str(ck), "--resume", "auto",
           "--metrics-out", str(m)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=ENV)
    deadline = time.monotonic() + 200
    while not (m.exists() and len(m.read_text().splitlines()) >= 3):
        assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()[-3000:]
        time.sleep(0.05)
    seen = len(m.read_text().splitlines())  # steps done before the signal
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0]  # a hang guard, not a measurement
    assert p.returncode == 75, out[-3000:]
    done = len(m.read_text().splitlines())
    assert seen <= done < steps, (seen, done, "the signal came too late to test anything")
    # the one checkpoint is the last step run: nothing ran after the save
    assert sorted(os.listdir(ck)) == [f"step-{done:06d}"], (done, sorted(os.listdir(ck)))
    assert (ck / f"step-{done:06d}" / "manifest.json").is_file()
    assert "preempted, resumable" in out
    print(f"SIGTERM after {seen} steps -> exit 75, saved step {done}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0 and f"resuming from {ck / f'step-{done:06d}'}" in r.stdout, \
        (r.stdout + r.stderr)[-3000:]
    ref = tmp_path / "ref.jsonl"
    r = fived("train", "--nprocs", "2", "--steps", str(steps), "--global-batch", "4",
              "--metrics-out", str(ref))
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = losses_of(m), losses_of(ref)
    assert sorted(got) == list(range(steps)) and got == want


# ------------------------------------------------------------------ bad steps
def _plant_nan(trainer):
    trainer.engine.owned_grads()[0].view(-1)[0] = float("nan")


def _nan_grads(trainer, step):
    """Rank 1 plants a NaN in its reduced gradient at step 2."""
    if trainer.rank == 1 and step == 2:
        _plant_nan(trainer)


def _nan_from3(trainer, step):
    if trainer.rank == 1 and step >= 3:
        _plant_nan(trainer)


def _sigterm_rank1(trainer, step):
    """Only rank 1 is signalled (as if only its node were told of the preemption)."""
    if trainer.rank == 1 and step == 2:
        os.kill(os.getpid(), signal.SIGTERM)


def _runs(rank, world, runs):
    from fived.testing import OnGrads
    from fived.train.trainer import train_rank

    return [train_rank(rank, world, m, p, t, show=False, hooks=[OnGrads(f)] if f else [])
            for m, p, t, f in runs]


def test_nan_gradient_on_one_rank_skips_the_step_and_k_in_a_row_stop(tmp_path):
    """(and: a preemption signal on one rank stops every rank after the same step)"""
    par = ParallelConfig(dp=2, zero=1)
    t = small_train(steps=6)
    d = tmp_path / "ck"
    stop_t = replace(t, steps=8, save_dir=str(d), save_every=2, max_bad_steps=2)
    pre_t = replace(t, save_dir=str(tmp_path / "pre"))
    ref, skip, stop, pre = run_ranks(_runs, 2, [
        (DENSE, par, t, None), (DENSE, par, t, _nan_grads), (DENSE, par, stop_t, _nan_from3),
        (DENSE, par, pre_t, _sigterm_rank1)], timeout=300)[0]
    # SIGTERM on rank 1 only: rank 0 (whose summary this is) agreed, both saved after step 2
    assert pre["preempted"] == 3 and pre["losses"] == ref["losses"][:3]
    assert sorted(p.name for p in (tmp_path / "pre").iterdir()) == ["step-000003"]
    # one NaN on rank 1's gradients: step 2 is skipped everywhere, counted, and the run goes on
    h = {r["step"]: r for r in skip["history"]}
    assert h[2]["skipped"] and h[2]["bad"] and not math.isfinite(h[2]["grad_norm"])
    assert skip["bad_steps"] == 1 and h[5]["bad_steps"] == 1
    assert not any(h[s]["bad"] for s in (0, 1, 3, 4, 5))
    assert all(math.isfinite(x) for x in skip["losses"]), skip["losses"]
    assert skip["losses"][:3] == ref["losses"][:3]  # the loss of step 2 is before its update
    assert skip["losses"][3] != ref["losses"][3]  # step 2 made no update
    # NaN from step 3 on, --max-bad-steps 2: stopped after step 4, nothing saved after step 2
    assert "stopped" in stop and "--max-bad-steps 2" in stop["stopped"]
    assert [r["step"] for r in stop["history"]] == [0, 1, 2, 3, 4]
    names = sorted(p.name for p in d.iterdir())
    assert names == ["step-000002"], names


# ------------------------------------------------------------------ full disk
def _enospc(rank, world, m, par, t):
    from torch.distributed.checkpoint import filesystem

    from fived.train.trainer import train_rank

    real = filesystem.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if rank == 1 and "step-000004" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, plan, planner)

    filesystem.FileSystemWriter.write_data = write_data
    return train_rank(rank, world, m, par, t, show=False)


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    d = tmp_path / "ck"
    par = ParallelConfig(dp=2, zero=2)
    t = small_train(steps=6, save_dir=str(d), save_every=2, keep=1)
    out = run_ranks(_enospc, 2, DENSE, par, t, timeout=300)
    print(out[0]["stopped"])
    for s in out:
        assert "No space left on device" in s["stopped"], s.get("stopped")
        assert "step-000002 is intact" in s["stopped"]
    assert sorted(p.name for p in d.iterdir()) == ["step-000002"]
    from fived.checkpoint import resolve, verify

    verify(resolve(d))  # complete, every checksum right


# ------------------------------------------------------------------ bounded history
def test_history_is_bounded_and_the_table_keeps_the_first_loss():
    from fived.train.metrics import summary_table
    from fived.train.resilience import History

    h = History(window=4)
    for s in range(10):
        h.add({"step": s, "loss": 10.0 - s, "skipped": s == 3, "tokens_per_s": 1.0, "mfu": 0.0,
               "seconds": 1.0, "memory_per_rank": [dict.fromkeys(
                   ("params", "grads", "master", "optimizer"), 0)],
               "traffic_per_rank": [{"bytes": {}}]})
    assert [r["step"] for r in h.records] == [6, 7, 8, 9]
    assert list(h.losses) == [10.0 - s for s in range(10)] and h.skipped == 1
    from rich.console import Console

    c = Console(record=True, width=120)
    c.print(summary_table(list(h.records), h))
    text = c.export_text()
    assert "10.0000 → 1.0000" in text and "1 of 10" in text


def test_resume_auto_says_what_it_does_before_torch_is_imported(tmp_path):
    """The line comes first (well under a second: torch is not imported to find it)."""
    r = subprocess.run([sys.executable, "-c", "import sys, fived.checkpoint.storage, "
                        "fived.cli.train; assert 'torch' not in sys.modules"], env=ENV)
    assert r.returncode == 0
    r = fived("train", "--nprocs", "1", "--steps", "2", "--save-dir", str(tmp_path / "ck"),
              "--resume", "auto", "--print-config")
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first == f"--resume auto: no complete checkpoint under {tmp_path / 'ck'}: starting fresh"
    assert not (tmp_path / "ck").exists()  # nothing written by --print-config
