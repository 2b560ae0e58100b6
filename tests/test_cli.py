"""The command line: a bad layout is one clean ConfigError; the JSONL of dp=2 equals dp=1.

Parsing and output run in this process (``run_cli``); the dp=2 run is the entry point's one
sample as a user types it (``python -m fived train``)."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import run_cli  # noqa: E402,I001

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def fived(*args, timeout=300):
    return run_cli(*args)


def fived_process(*args, timeout=300):
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
    assert r.returncode == 2 and "no such preset" in r.stderr and "Traceback" not in r.stderr


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
    """Time: the entry point's one process sample of ``fived train`` (an interpreter and two
    spawned ranks each importing torch: ~10 s on a quiet machine)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    # dp=2 as a user types it (the ranks print the closing table); dp=1 in this process
    r1 = fived_process("train", "--dp", "2", "--steps", "5", "--metrics-out", str(a))
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
    from fived.ranks.grid import Grid

    g = Grid.from_config(ParallelConfig(dp=world), rank).connect(Traffic())
    if rank == 1:
        raise ValueError("boom on rank one")
    ops.all_reduce(torch.ones(4), g["dp"])  # rank 0 blocks here until it is killed


def test_failing_rank_is_reported_and_others_stopped():
    from fived.ranks.launch import RankFailure
    from fived.testing import run_ranks

    with pytest.raises(RankFailure) as e:
        run_ranks(_fails_on_rank_one, 2, timeout=60)
    assert e.value.rank == 1 and "boom on rank one" in e.value.detail


# ------------------------------------------------------------------ one flag set
def _help(capsys, cmd):
    from fived.cli import main

    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    return capsys.readouterr().out


def test_every_train_field_is_a_flag_with_its_default(capsys):
    from dataclasses import fields

    from fived.config import TrainConfig, flag_of

    out = _help(capsys, "train")
    for f in fields(TrainConfig):
        assert flag_of("train", f.name) in out, f.name
    for group in ("model:", "layout:", "run:", "configuration:", "launch:"):
        assert group in out
    assert "(default: auto)" in out and "(default: 16)" in out
    for old in ("--tp", "--cp", "--ep", "--dp", "--pp", "--zero", "--schedule", "--virtual-stages",
                "--micro-batches", "--sequence-parallel", "--recompute", "--precision",
                "--grad-reduce-dtype", "--cp-mode", "--bucket-mb", "--no-overlap", "--pp-layers",
                "--order", "--steps", "--global-batch", "--seq-len", "--lr", "--seed",
                "--metrics-out", "--model", "--config", "--nprocs", "--timeout"):
        assert old in out, old
    ledger = _help(capsys, "ledger")
    assert "--precision" in ledger and "(default: auto)" in ledger and "--check" in ledger


def _config(capsys, argv):
    import tomllib

    from fived.cli import main

    assert main([*argv, "--print-config"]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_same_defaults_everywhere(capsys):
    train = _config(capsys, ["train"])
    ledger = _config(capsys, ["ledger"])
    plan = _config(capsys, ["plan"])
    # --precision auto: fp32 for `fived train` on this cpu, bf16 on the ledger's GPU preset;
    # the ledger of this machine is the ledger of what `fived train` runs: dp 4 on 4 ranks, fp32
    assert ledger["parallel"].pop("precision") == "bf16"
    assert train["parallel"].pop("precision") == "fp32"
    assert train == ledger
    here = _config(capsys, ["ledger", "--gpu", "this-machine"])
    assert here["parallel"].pop("precision") == "fp32" and here == train
    assert train["parallel"]["dp"] == 4
    assert plan["model"] == train["model"] and plan["train"] == train["train"]
    flags = ["--tp", "2", "--zero", "1", "--precision", "bf16", "--global-batch", "8"]
    assert _config(capsys, ["train", *flags]) == _config(capsys, ["ledger", *flags])


def test_precedence_defaults_toml_flags(capsys, tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[model]\nname = "tiny"\nlayers = 2\n[train]\nsteps = 7\nlr = 0.01\n')
    doc = _config(capsys, ["train", "--config", str(f), "--steps", "3"])
    assert doc["train"]["steps"] == 3 and doc["train"]["lr"] == 0.01 and doc["model"]["layers"] == 2
    # --model with a TOML whose [model] sets the shape: an error naming both (issue 45: it ran
    # the TOML's shape labelled with --model's name); the TOML's name = "small" does it
    from parity_helpers import cli_exits_2

    err = cli_exits_2(["train", "--config", str(f), "--model", "small"], "--model small")
    assert str(f) in err and "layers 2" in err
    f.write_text('[model]\nname = "small"\nlayers = 2\n')
    doc = _config(capsys, ["train", "--config", str(f)])
    assert doc["model"]["name"] == "small" and doc["model"]["hidden"] == 128
    assert doc["model"]["layers"] == 2 and doc["train"]["model"] == "small"
    # a [model] of the name alone: the flag overrides it (flags over TOML)
    f.write_text('[model]\nname = "tiny"\n')
    doc = _config(capsys, ["train", "--config", str(f), "--model", "small"])
    assert doc["model"]["name"] == "small" and doc["model"]["layers"] == 8
    # --virtual-stages alone picks the interleaved schedule
    doc = _config(capsys, ["train", "--pp", "2", "--virtual-stages", "2", "--micro-batches", "2",
                           "--global-batch", "8"])
    assert doc["parallel"]["schedule"] == "interleaved"


def test_print_config_round_trips(capsys, tmp_path):
    first = _config(capsys, ["train", "--tp", "2", "--zero", "1", "--lr", "0.001",
                             "--metrics-out", "m.jsonl"])
    from fived.config import dump_toml, load_toml

    f = tmp_path / "eff.toml"
    from fived.cli import main

    main(["train", "--tp", "2", "--zero", "1", "--lr", "0.001", "--metrics-out", "m.jsonl",
          "--print-config"])
    f.write_text(capsys.readouterr().out)
    assert _config(capsys, ["train", "--config", str(f)]) == first
    assert dump_toml(*load_toml(f)).strip() in f.read_text()


def test_bench_flags_share_the_table(capsys, tmp_path):
    import argparse

    from fived.ui import flags

    def parser():
        ap = argparse.ArgumentParser(prog="fived bench x")
        flags.add_flag(ap, "pp", default=4)
        flags.add_flag(ap, "micro_batches", default=8)
        return ap

    a = flags.parse(parser(), [])
    assert (a.pp, a.micro_batches) == (4, 8)
    f = tmp_path / "b.toml"
    f.write_text("[parallel]\nmicro_batches = 2\n")
    a = flags.parse(parser(), ["--config", str(f), "--pp", "2"])
    assert (a.pp, a.micro_batches) == (2, 2)
    with pytest.raises(SystemExit) as e:
        flags.parse(parser(), ["--pp", "0"])
    assert e.value.code == 2 and "--pp must be >= 1" in capsys.readouterr().err
    assert "(default: 8)" in " ".join(parser().format_help().split())
