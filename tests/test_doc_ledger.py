"""The ledger under document masks (issue 41): attention FLOPs follow Σ Lᵢ² instead of S²
(``compute.doc_context``, the clock's ``attn_context``, ``fived ledger --doc-len``), and
``fived ledger --check`` of a ``--doc-mask`` run stays exact.

Mutation seen to fail: ``_attention_ops`` ignoring ``attn_context`` (the flop ratio test)."""

import json

import pytest
from doc_helpers import prepared
from parity_helpers import cli_exits_2, run_cli

from fived.config import ParallelConfig, preset
from fived.ledger.compute import doc_context
from fived.ledger.roofline import ClockOptions, block_ops


def test_doc_context_is_the_sum_of_squared_pieces_over_the_windows():
    # windows of 8 over the stream 3,5 | 2,6 | 4 (incomplete, dropped as the loader drops it)
    assert doc_context(8, lengths=[3, 5, 2, 6, 4]) == (9 + 25 + 4 + 36) / 16
    # a document longer than the window is cut into window-long pieces
    assert doc_context(8, lengths=[20, 4]) == (64 + 64 + 16 + 16) / 24
    assert doc_context(2048, mean=2048) == 2048
    assert doc_context(2048, mean=512) == 512
    assert doc_context(2048, mean=128) == 128


def test_the_clock_charges_attention_by_the_documents():
    m, par = preset("small"), ParallelConfig(cp=2)

    def attn(ctx):
        ops = block_ops(m, par, 2, ClockOptions(attn_context=ctx))
        return sum(o.flops for o in ops["fwd"] + ops["bwd"] if o.name.startswith("attn"))

    assert attn(0) == attn(m.seq_len) > 0
    assert attn(m.seq_len / 4) == pytest.approx(attn(0) / 4)


def ledger_json(*flags):
    r = run_cli("ledger", "--model", "small", "--seq-len", "2048", "--gpus", "8", "--tp", "2",
                "--cp", "2", "--json", *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["time"]["components"]["compute"]


def test_ledger_doc_len_lowers_the_compute_and_bad_values_exit_2(tmp_path):
    full, quarter, small = ledger_json(), ledger_json("--doc-len", "512"), ledger_json(
        "--doc-len", "128")
    assert full > quarter > small
    cli_exits_2(["ledger", "--model", "small", "--gpus", "8", "--doc-len", "0"], "--doc-len")
    cli_exits_2(["ledger", "--model", "small", "--gpus", "8", "--doc-len",
                 str(tmp_path / "missing")], "--doc-len")


def test_ledger_check_of_a_doc_mask_run_is_exact(tmp_path):
    """Model-state and traffic bytes of a cp2 ``--doc-mask`` run equal the ledger's (the ring
    still sends every K/V block: a skipped pair saves compute, not traffic).

    Time: a two-rank `fived train` and the check (31 s under load)."""
    data = prepared(tmp_path / "d")
    m = tmp_path / "m.jsonl"
    r = run_cli("train", "--data", data, "--steps", "1", "--nprocs", "2", "--cp", "2",
                "--doc-mask", "--metrics-out", str(m))
    assert r.returncode == 0, r.stderr
    r = run_cli("ledger", "--check", str(m))
    assert r.returncode == 0 and "exact" in r.stdout, r.stdout + r.stderr
