"""`fived plan` and `fived ledger`: --help, --json documents, the 7B headline, this-machine."""

import json

import pytest

from fived.cli import main
from fived.ledger import hardware
from fived.ui.report import parse_count


def _json(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_parse_count():
    assert parse_count("4M") == 4 * 2**20
    assert parse_count("1T", binary=False) == 10**12
    assert parse_count("512") == 512


def test_help_teaches(capsys):
    for cmd in ("plan", "ledger"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "examples:" in out and "--gpu" in out


def test_ledger_7b_example_json(capsys):
    rc, doc = _json(capsys, ["ledger", "--model", "llama2-7b", "--gpus", "8", "--gpu",
                             "rtx-pro-6000", "--zero", "3", "--precision", "bf16", "--json"])
    assert rc == 0
    md = doc["model"]
    assert md["params"] == 6_738_415_616
    assert md["checkpoint_bf16_bytes"] == 2 * md["params"]  # 13.5 GB ("14 GB")
    assert md["training_state_16psi_bytes"] == 16 * md["params"]  # 107.8 GB
    assert md["training_state_fits_one_device"] is False  # more than one 96 GB card
    assert doc["layout"]["dp"] == 8 and doc["fits"]
    st = doc["memory"]["states"]
    assert sum(st.values()) == 18 * md["params"] // 8  # ZeRO-3, fp32 grad buffer
    assert set(doc["traffic"]["bytes_by_group"]) == {"dense"}


def test_ledger_tables_print(capsys):
    assert main(["ledger", "--model", "tiny", "--gpus", "2", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "memory of the largest rank" in out and "traffic per step" in out


def test_ledger_rejects_bad_layout(capsys):
    assert main(["ledger", "--model", "llama2-7b", "--gpus", "8", "--tp", "3"]) == 2


def test_plan_json_small(capsys):
    rc, doc = _json(capsys, ["plan", "--model", "llama2-7b", "--gpus", "8", "--gpu",
                             "rtx-pro-6000", "--global-batch-tokens", "256K", "--top", "3",
                             "--micro-batch-sizes", "1", "--recompute", "none,full", "--json"])
    assert rc == 0 and len(doc["top"]) == 3
    for p in doc["top"]:
        assert p["fits"] and p["memory"]["total"] <= p["device_memory"]
    assert doc["reasons"]


def test_plan_prints_why(capsys):
    assert main(["plan", "--model", "small", "--gpus", "4", "--gpu", "a100-80gb",
                 "--global-batch", "16", "--top", "3", "--micro-batch-sizes", "1"]) == 0
    assert "why the best one wins" in capsys.readouterr().out


def test_this_machine_fits_bench_rows(tmp_path):
    rows = [{"op": "all_reduce", "size": s, "n": 2, "seconds": 20e-6 * 2 + s / 1e9}
            for s in (1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"results": rows}))
    hw = hardware.this_machine(str(p))
    assert hw.intra_bw == pytest.approx(1e9, rel=1e-6)
    assert hw.intra_latency == pytest.approx(20e-6, rel=1e-6)
    assert hw.peak_flops > 0


def test_this_machine_reads_the_bench_fits(tmp_path):
    doc = {"schema": 1, "world": 4, "rows": [],
           "fits": {"all_reduce": {"alpha_us": 60.0, "beta_GBps": 2.0, "points": 5,
                                   "max_rel_err": 0.1}}}
    p = tmp_path / "bench.json"
    p.write_text(json.dumps(doc))
    hw = hardware.this_machine(str(p))
    assert hw.intra_bw == 2e9
    assert hw.intra_latency == pytest.approx(60e-6 / 6)  # 2(n−1) = 6 ring steps


def test_ledger_plan_and_checks_import_no_torch():
    """The ledger, the planner and every refusal answer without importing torch (fast)."""
    import subprocess
    import sys

    code = ("import sys; from fived.cli import main; "
            "assert main(['ledger']) == 0; assert main(['plan', '--top', '1']) == 0; "
            "assert main(['grid', '--tp', '2']) == 0; "
            "assert main(['train', '--print-config']) == 0; assert main(['train', '--tp', '0']) == 2; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
