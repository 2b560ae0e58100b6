"""Every hole a new user hit, closed: bad input is one message naming the flag, exit code 2, no
traceback, no rank started, nothing written."""

import json
import os
import subprocess
import sys

import pytest

from fived.cli import main
from fived.config import ParallelConfig, preset


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank would start."""
    from fived.ranks import launch

    def never(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "run_local", never)


def refused(capsys, argv, *needles):
    from parity_helpers import Words

    rc = main(argv)
    out, err = capsys.readouterr()
    err = Words(err)  # messages fold at 80 columns: a needle may span a line break
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("argv, flag", [
    (["train", "--tp", "0"], "--tp must be >= 1"),
    (["train", "--pp", "0"], "--pp must be >= 1"),
    (["train", "--micro-batches", "0"], "--micro-batches must be >= 1"),  # was ZeroDivisionError
    (["train", "--global-batch", "0"], "--global-batch must be >= 1"),
    (["train", "--lr", "-1"], "--lr must be > 0"),
    (["train", "--steps", "0"], "--steps must be >= 1"),
    (["train", "--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1]"),
    (["train", "--beta2", "1"], "--beta2 must be in [0, 1)"),
    (["train", "--eps", "0"], "--eps must be > 0"),
    (["train", "--warmup", "-1"], "--warmup must be >= 0"),
    (["train", "--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["train", "--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["train", "--bucket-mb", "0"], "--bucket-mb must be > 0"),
    (["train", "--corpus-mb", "0"], "--corpus-mb must be > 0"),
    (["train", "--nprocs", "0"], "--nprocs must be"),
])
def test_train_refuses_bad_values_before_any_rank(capsys, no_ranks, argv, flag):
    refused(capsys, argv, flag)


def test_ledger_tp_zero_is_refused_not_read_as_one(capsys):
    refused(capsys, ["ledger", "--tp", "0"], "--tp must be >= 1")
    refused(capsys, ["ledger", "--micro-batches", "0"], "--micro-batches must be >= 1")
    refused(capsys, ["grid", "--tp", "0"], "--tp must be >= 1")


def test_zero3_with_pipeline_takes_a_gather_mode(capsys, no_ranks):
    for cmd in ("train", "ledger"):
        with pytest.raises(SystemExit) as e:  # argparse's own choice check: exit 2
            main([cmd, "--pp", "2", "--dp", "2", "--zero", "3", "--zero3-pp-gather", "often"])
        assert e.value.code == 2
        assert "--zero3-pp-gather" in capsys.readouterr().err
    assert main(["ledger", "--pp", "2", "--dp", "2", "--zero", "3"]) == 0


def test_plan_searches_zero3_with_pipeline_and_the_v_schedules():
    from fived.ledger import hardware, planner

    res = planner.plan(preset("small"), 8, hardware.PRESETS["a100-80gb"], 32, 8,
                       micro_batch_sizes=(1,), recomputes=("none",), zeros=(1, 3),
                       schedules=("1f1b", "zb-v"), top=1000)
    assert res.ranked and not res.counts.get("invalid")
    assert any(p.par.zero == 3 and p.par.pp > 1 for p in res.ranked)
    assert any(p.par.schedule == "zb-v" and p.par.virtual_stages == 2 for p in res.ranked)


def test_pipeline_checks_live_in_validate():
    from dataclasses import replace

    from fived.config import ConfigError, validate

    tied = replace(preset("tiny"), tied_embeddings=True)
    validate(tied, ParallelConfig(pp=2))  # the embedding group: tied works with a pipeline
    validate(tied, ParallelConfig(tp=2))
    validate(preset("tiny"), ParallelConfig(pp=2, zero=3, schedule="zb-h1"))  # built now
    with pytest.raises(ConfigError, match="exactly 2 stages per rank"):
        validate(preset("tiny"), ParallelConfig(pp=2, schedule="zb-v"))
    with pytest.raises(ConfigError, match="dualpipe-v needs --micro-batches >= 2·pp = 4"):
        validate(preset("tiny"), ParallelConfig(pp=2, schedule="dualpipe-v", virtual_stages=2,
                                                micro_batches=2))


def _toml(tmp_path, text):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return str(p)


def _printed(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    import tomllib

    return out, tomllib.loads(out)


def test_toml_dp_is_honoured(capsys, tmp_path):
    one = _toml(tmp_path, "[parallel]\ndp = 1\n")
    out, doc = _printed(capsys, ["train", "--config", one, "--print-config"])
    assert doc["parallel"]["dp"] == 1 and "1 rank(s)" in out  # was: ran as dp4
    three = _toml(tmp_path, "[parallel]\ndp = 3\n[train]\nglobal_batch = 6\n")
    out, doc = _printed(capsys, ["train", "--config", three, "--print-config"])  # validates
    assert doc["parallel"]["dp"] == 3 and doc["train"]["global_batch"] == 6
    assert "3 rank(s)" in out
    _, doc = _printed(capsys, ["ledger", "--config", three, "--print-config"])
    assert doc["parallel"]["dp"] == 3
    # a flag still overrides the TOML, and without dp anywhere dp fills the 4 default ranks
    _, doc = _printed(capsys, ["train", "--config", three, "--dp", "2", "--print-config"])
    assert doc["parallel"]["dp"] == 2
    _, doc = _printed(capsys, ["train", "--tp", "2", "--print-config"])
    assert doc["parallel"]["dp"] == 2


def test_metrics_out_into_a_missing_directory(capsys, no_ranks, tmp_path):
    refused(capsys, ["train", "--metrics-out", "/nonexistent/dir/x.jsonl"], "--metrics-out",
            "does not exist")
    assert not os.path.exists("/nonexistent/dir")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root can write anywhere
            refused(capsys, ["train", "--metrics-out", str(locked / "m.jsonl")], "--metrics-out",
                    "not writable")
    finally:
        locked.chmod(0o700)
    refused(capsys, ["train", "--metrics-out", str(tmp_path)], "--metrics-out", "is a directory")
    assert list(tmp_path.iterdir()) == [locked]  # nothing written


def test_plan_gpus_zero_names_the_flag(capsys):
    err = refused(capsys, ["plan", "--gpus", "0"], "--gpus")
    assert "no layout fits" not in err
    refused(capsys, ["plan", "--zero", "0,5"], "--zero")
    refused(capsys, ["plan", "--micro-batch-sizes", "0"], "--micro-batch-sizes")
    refused(capsys, ["ledger", "--gpus", "-1"], "--gpus")


def test_process_level_error_rule(capsys):
    """The installed command: exit code 2, one message, no traceback; one sample as a process,
    the rest through ``main`` in this process."""
    r = subprocess.run([sys.executable, "-m", "fived", "train", "--micro-batches", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r
    assert "--micro-batches" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert r.stderr.count("ConfigError") == 1
    for argv, flag in ((["ledger", "--tp", "0"], "--tp"),
                       (["train", "--pp", "2", "--schedule", "dualpipe-v", "--micro-batches",
                         "2"], "--schedule dualpipe-v")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert flag in err and err.count("ConfigError") == 1, err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--tp", "two"])
    assert e.value.code == 2
    assert "--tp" in capsys.readouterr().err


# ------------------------------------------------------------------ tables fit 80 columns
def _at_80(monkeypatch, capsys, argv):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(argv) in (0, 1)
    out = capsys.readouterr().out
    assert "…" not in out, out
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80  # the ledger command too
    return out


def test_plan_fits_80_columns(monkeypatch, capsys):
    out = _at_80(monkeypatch, capsys, ["plan", "--model", "llama3-70b", "--gpus", "64"])
    assert "top 10 layouts" in out and "MFU" in out
    wide = main(["plan", "--model", "small", "--gpus", "4", "--global-batch", "16", "--top", "2",
                 "--micro-batch-sizes", "1", "--wide"])
    assert wide == 0 and "tokens/s" in capsys.readouterr().out


def test_ledger_and_grid_fit_80_columns(monkeypatch, capsys):
    _at_80(monkeypatch, capsys, ["ledger", "--model", "llama3-70b", "--gpus", "64", "--tp", "8",
                                 "--pp", "4", "--sequence-parallel", "--zero", "1", "--precision",
                                 "bf16", "--micro-batches", "64", "--global-batch-tokens", "4M"])
    _at_80(monkeypatch, capsys, ["ledger", "--model", "mixtral-8x7b", "--gpus", "32", "--ep", "8",
                                 "--tp", "2", "--pp", "2", "--global-batch", "64",
                                 "--micro-batches", "4"])
    _at_80(monkeypatch, capsys, ["grid", "--tp", "2", "--cp", "2", "--ep", "2", "--pp", "2", "--dp",
                                 "8", "--gpus-per-node", "8"])


def test_plan_json_is_machine_output(capsys):
    assert main(["plan", "--model", "small", "--gpus", "4", "--global-batch", "16", "--top", "2",
                 "--micro-batch-sizes", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["top"]) == 2 and doc["precision"] == "bf16"  # auto on a GPU preset
    assert doc["precision_note"] == "precision bf16 (auto: h100-sxm)"


# ------------------------------------------------------------------ help that tells the truth
def test_figures_help_lists_the_real_figures(capsys):
    assert main(["figures", "--help"]) == 0
    out = capsys.readouterr().out
    assert "schedule" in out and "comm" not in out
    assert main(["figures", "nope"]) == 2
    assert "schedule" in capsys.readouterr().err


def test_every_runtime_dependency_is_used():
    """A runtime dependency that no module imports is a hole (safetensors once was one; it is
    now the Hugging Face format of fived.checkpoint.hf)."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    source = "\n".join(p.read_text() for p in (root / "fived").rglob("*.py"))
    imported_as = {"tensorboard": "torch.utils.tensorboard"}
    for dep in deps:
        name = re.split(r"[<>=!~\[ ]", dep, maxsplit=1)[0]
        mod = imported_as.get(name, name)
        assert re.search(rf"^\s*(from|import) {re.escape(mod)}\b", source, re.M), dep
