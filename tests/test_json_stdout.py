"""With --json, stdout carries the JSON document alone (progress and tables go to stderr), so
`fived ... --json | python -m json.tool` reads it.

Benchmarks: tests/test_bench_schema.py runs every bench that has --json in this process,
validates its whole stdout as one ``fived.bench`` document and checks that it was written under
``schema.json_stdout``; here, that no bench with --json is missing from its list, and that the
wrapper keeps file descriptor 1 for the document in a real process -- against Python's prints,
raw writes to the descriptor and a child process that inherits it (as the spawned ranks do).
The real benches as processes, each validated: ``slow``. Commands (ledger, plan, grid, data,
checkpoint inspect): in this process."""

import importlib
import json
import os
import subprocess
import sys

import pytest
from test_bench_schema import TINY

from fived.bench import schema

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_every_bench_with_json_is_listed(capsys):
    from fived.cli.main import modules

    has_json = set()
    for name in modules("fived.bench"):
        main = importlib.import_module(f"fived.bench.{name.replace('-', '_')}").main
        with pytest.raises(SystemExit):
            main(["--help"])
        if "--json" in capsys.readouterr().out:
            has_json.add(name)
    assert has_json == set(TINY)


FAKE_BENCH = """
import os, subprocess, sys
from fived.bench import schema

@schema.json_stdout
def main(argv):
    print("progress on sys.stdout")
    sys.stdout.flush()
    os.write(1, b"raw write to descriptor 1\\n")
    subprocess.run([sys.executable, "-c", "print('a child process inheriting descriptor 1')"],
                   check=True)
    schema.emit(schema.document("fake", argv, [schema.row("v", "x", 1.0, peer=True)],
                                mach={k: None for k in schema.MACHINE_FIELDS}))
    print("after the document")
    return 0

sys.exit(main(sys.argv[1:]))
"""


def test_json_stdout_keeps_descriptor_1_for_the_document():
    r = subprocess.run([sys.executable, "-c", FAKE_BENCH, "--json"], capture_output=True,
                       text=True, timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # the whole of stdout: one document, nothing before or after
    schema.validate(doc)
    assert doc["command"] == "fived bench fake --json"
    for line in ("progress on sys.stdout", "raw write to descriptor 1",
                 "a child process inheriting descriptor 1", "after the document"):
        assert line in r.stderr, (line, r.stderr)  # the human lines went to stderr, not away
    r = subprocess.run([sys.executable, "-c", FAKE_BENCH], capture_output=True, text=True,
                       timeout=60, env=ENV)
    assert r.returncode == 0 and r.stdout.startswith("progress on sys.stdout")  # no --json


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(TINY) - {"data"}))
def test_bench_json_is_stdout_alone_in_a_process(name):
    r = subprocess.run([sys.executable, "-m", "fived", "bench", name, *TINY[name], "--json"],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    schema.validate(json.loads(r.stdout))
    assert r.stderr.strip()


def only_json(r) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)  # the whole of stdout: one document, nothing before or after


def test_commands_json_is_stdout_alone(tmp_path):
    from parity_helpers import run_cli

    assert only_json(run_cli("ledger", "--model", "tiny", "--gpus", "2", "--json"))
    assert only_json(run_cli("plan", "--model", "small", "--gpus", "4", "--top", "1", "--json"))
    assert only_json(run_cli("grid", "--tp", "2", "--dp", "2", "--json"))
    src = tmp_path / "txt"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"document {i} " * 200)
    out = tmp_path / "dd"
    assert only_json(run_cli("data", "prepare", str(src), "--out", str(out), "--val-fraction",
                             "0", "--json"))
    assert only_json(run_cli("data", "info", str(out), "--json"))
    ck = tmp_path / "ck"
    r = run_cli("train", "--nprocs", "1", "--steps", "1", "--save-dir", str(ck))
    assert r.returncode == 0, r.stderr[-2000:]
    man = only_json(run_cli("checkpoint", "inspect", str(ck), "--json"))
    assert man["config"]["parallel"]["precision"] == "fp32"  # what ran (auto on the cpu)
