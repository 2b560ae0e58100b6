"""With --json, stdout carries the JSON document alone (progress and tables go to stderr), so
`fived ... --json | python -m json.tool` reads it: every command and benchmark that has --json,
each at settings cheap enough for a test (seconds each)."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

BENCHES = {
    "ddp": ["--hidden", "32", "--layers", "1", "--seq-len", "16", "--global-batch", "4",
            "--reps", "1", "--steps", "1", "--warmup", "0"],
    "zero": ["--hidden", "32", "--layers", "1", "--seq-len", "16", "--global-batch", "4",
             "--reps", "1", "--steps", "1", "--warmup", "0"],
    "cp": ["--cp", "2", "--batch", "1", "--seq", "64", "--heads", "2", "--kv-heads", "1",
           "--head-dim", "8", "--iters", "1", "--warmup", "0"],
    "ep": ["--eps", "1,2", "--steps", "1"],
    "pp": ["--pp", "2", "--layers", "2", "--reps", "1", "--micro-batches", "4",
           "--global-batch", "4"],
    "tp": ["--tp", "2", "--reps", "1", "--warmup", "0", "--batch", "1"],
    "data": ["--batches", "2", "--steps", "1", "--corpus-mb", "0.2"],
    "comm": ["--nprocs", "2", "-b", "1K", "-e", "2K", "-f", "2", "--iters", "1", "--warmup", "0"],
    "generate": ["--model", "tiny", "--reps", "1", "--prompt-len", "8", "--new-tokens", "4"],
}


def fived(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fived", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def only_json(r) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)  # the whole of stdout: one document, nothing before or after


def test_every_bench_with_json_is_listed():
    from fived.cli.main import modules

    has_json = {n for n in modules("fived.bench")
                if "--json" in fived("bench", n, "--help").stdout}
    assert has_json == set(BENCHES)


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_json_is_stdout_alone(name):
    r = fived("bench", name, *BENCHES[name], "--json")
    doc = only_json(r)
    assert isinstance(doc, dict) and doc
    assert r.stderr.strip()  # the human lines went to stderr, not away


def test_commands_json_is_stdout_alone(tmp_path):
    only_json(fived("ledger", "--model", "tiny", "--gpus", "2", "--json"))
    only_json(fived("plan", "--model", "small", "--gpus", "4", "--top", "1", "--json"))
    only_json(fived("grid", "--tp", "2", "--dp", "2", "--json"))
    src = tmp_path / "txt"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"document {i} " * 200)
    out = tmp_path / "dd"
    only_json(fived("data", "prepare", str(src), "--out", str(out), "--val-fraction", "0",
                    "--json"))
    only_json(fived("data", "info", str(out), "--json"))
    ck = tmp_path / "ck"
    r = fived("train", "--nprocs", "1", "--steps", "1", "--save-dir", str(ck))
    assert r.returncode == 0, r.stderr[-2000:]
    man = only_json(fived("checkpoint", "inspect", str(ck), "--json"))
    assert man["config"]["parallel"]["precision"] == "fp32"  # what ran (auto on the cpu)
