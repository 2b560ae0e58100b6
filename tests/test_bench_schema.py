"""Every ``fived bench NAME --json`` prints one ``fived.bench`` v1 document (docs/benchmarks.md)
and nothing else on stdout: each bench run in this process at a tiny size (seconds), the whole
of its stdout parsed as one document and validated (``schema.validate``), each ratio recomputed
from its rows, the document written under ``schema.json_stdout``, and what the bench's rows
promise checked. ``TINY`` lists every bench with ``--json`` (tests/test_json_stdout.py checks
that none is missing, and the wrapper's file-descriptor half in a process)."""

import importlib
import json
import math

import pytest

from fived.bench import schema

TINY = {
    "comm": ["--nprocs", "2", "-b", "4K", "-e", "4K", "--ops", "all_reduce,all_gather",
             "--iters", "2", "--warmup", "1", "--no-progress"],
    "ddp": ["--nprocs", "2", "--hidden", "32", "--layers", "1", "--seq-len", "16", "--reps", "2",
            "--steps", "1", "--warmup", "1"],
    "zero": ["--nprocs", "2", "--hidden", "32", "--layers", "1", "--seq-len", "16",
             "--global-batch", "2", "--reps", "1", "--steps", "1", "--warmup", "0"],
    "tp": ["--tp", "2", "--model", "tiny", "--sp", "on", "--batch", "1", "--reps", "1",
           "--warmup", "0"],
    "pp": ["--pp", "2", "--model", "tiny", "--layers", "4", "--schedules", "1f1b,interleaved",
           "--micro-batches", "2", "--global-batch", "2", "--reps", "1"],
    "cp": ["--cp", "2", "--batch", "1", "--seq", "32", "--heads", "2", "--kv-heads", "1",
           "--head-dim", "8", "--iters", "1", "--warmup", "0"],
    "ep": ["--eps", "1,2", "--steps", "1", "--global-batch", "2", "--seq-len", "16",
           "--experts-per-rank", "2", "--matmul-reps", "1", "--matmul-iters", "1"],
    "data": ["--model", "tiny", "--global-batch", "2", "--batches", "2", "--steps", "1",
             "--corpus-mb", "0.2", "--min-ratio", "0"],
    "generate": ["--model", "tiny", "--reps", "1", "--prompt-len", "8", "--new-tokens", "4"],
}


def _check_ratios(doc):
    peers = {r["variant"]: r for r in doc["rows"] if r["peer"]}
    for r in doc["rows"]:
        if r["variant"] in peers:
            assert math.isclose(r["ratio"], schema.ratio(r, peers[r["variant"]]))
        else:
            assert r["ratio"] is None


def bench_doc(name: str, capsys, monkeypatch, argv: list[str] | None = None) -> dict:
    """``fived bench NAME ARGV --json`` in this process: its whole stdout, one valid document,
    written while ``schema.json_stdout`` held file descriptor 1 for it (in a process, the ranks'
    prints go to stderr then: tests/test_json_stdout.py)."""
    main = importlib.import_module(f"fived.bench.{name}").main
    emit_text, wrapped = schema.emit_text, []

    def spy(text):
        wrapped.append(bool(schema._JSON_OUT))
        emit_text(text)

    monkeypatch.setattr(schema, "emit_text", spy)
    assert main([*(TINY[name] if argv is None else argv), "--json"]) == 0
    assert wrapped == [True], f"fived.bench.{name}: the document not emitted under json_stdout"
    doc = json.loads(capsys.readouterr().out)  # all of stdout: nothing before or after
    schema.validate(doc)
    _check_ratios(doc)
    assert doc["bench"] == name and doc["command"].startswith(f"fived bench {name} ")
    return doc


def test_validate_rejects_what_is_not_the_schema():
    good = schema.document("x", ["--a"], [schema.row("v", "fived", 0.5),
                                          schema.row("v", "torch", 1.0, peer=True)],
                           mach={k: None for k in schema.MACHINE_FIELDS})
    assert good["rows"][0]["ratio"] == 0.5 and good["command"] == "fived bench x --a"
    # with per-repetition times: the median of the paired ratios, not the ratio of medians
    a = schema.row("v", "fived", 2.0, times_s=[1.0, 2.0, 9.0])
    b = schema.row("v", "torch", 4.0, peer=True, times_s=[2.0, 8.0, 3.0])
    assert schema.with_ratios([a, b])[0]["ratio"] == 0.5 and b["ratio"] == 1.0
    for breaks in (lambda d: d.pop("machine"), lambda d: d.update(version=2),
                   lambda d: d["rows"][0].pop("optimizer_s"),
                   lambda d: d["rows"][0].update(step_s=0.0),
                   lambda d: d["rows"][0].update(state_bytes=1.5),
                   lambda d: d["rows"][0].update(peer=True),
                   lambda d: d.update(rows=[])):
        bad = json.loads(json.dumps(good))
        breaks(bad)
        with pytest.raises(ValueError):
            schema.validate(bad)


def test_bench_comm_schema(capsys, monkeypatch):
    doc = bench_doc("comm", capsys, monkeypatch)
    assert doc["extra"]["world"] == 2
    assert {(r["variant"], r["implementation"]) for r in doc["rows"]} == {
        (f"{op} 4K", impl) for op in ("all_reduce", "all_gather") for impl in ("backend", "ring")}
    for r in doc["rows"]:  # the ring and the backend charge the same bytes here (4K / 2)
        assert r["bytes_sent"] == r["extra"]["bus_bytes"] and r["state_bytes"] is None


def test_bench_ddp_schema(capsys, monkeypatch):
    doc = bench_doc("ddp", capsys, monkeypatch)
    by = {r["implementation"]: r for r in doc["rows"]}
    assert set(by) == {"fived DDP", "fived DDP no-overlap", "torch DDP"}
    assert by["torch DDP"]["peer"] and by["torch DDP"]["ratio"] == 1.0
    # same model states on both sides, the optimizer timed on both, the same first loss
    assert by["fived DDP"]["state_bytes"] == by["torch DDP"]["state_bytes"]
    assert all(r["optimizer_s"] > 0 for r in doc["rows"])
    assert len({r["extra"]["first_loss"] for r in doc["rows"]}) == 1
    assert by["fived DDP"]["bytes_sent"] > 0 and by["torch DDP"]["bytes_sent"] is None


def test_bench_zero_schema(capsys, monkeypatch):
    doc = bench_doc("zero", capsys, monkeypatch)
    by = {r["implementation"]: r for r in doc["rows"]}
    assert set(by) == {"fived ZeRO-1", "fived ZeRO-2", "fived ZeRO-3", "fived ZeRO-3 no-overlap",
                       "torch FSDP2", "torch FSDP1", "torch DDP"}
    assert [r["implementation"] for r in doc["rows"] if r["peer"]] == ["torch FSDP2"]
    assert by["fived ZeRO-3"]["state_bytes"] == by["torch FSDP2"]["state_bytes"]
    assert by["fived ZeRO-1"]["state_bytes"] > by["fived ZeRO-2"]["state_bytes"] > by[
        "fived ZeRO-3"]["state_bytes"]
    assert all(r["optimizer_s"] > 0 for r in doc["rows"])
    assert len({r["extra"]["first_loss"] for r in doc["rows"]}) == 1


def test_bench_tp_schema(capsys, monkeypatch):
    doc = bench_doc("tp", capsys, monkeypatch)
    assert [(r["variant"], r["implementation"], r["peer"]) for r in doc["rows"]] == [
        ("tp+sp", "fived", False), ("tp+sp", "DTensor", True)]
    for r in doc["rows"]:
        assert r["extra"]["grad_rel_gap"] < 1e-4 and r["optimizer_s"] > 0


def test_bench_pp_schema(capsys, monkeypatch):
    doc = bench_doc("pp", capsys, monkeypatch)
    assert [(r["variant"], r["implementation"], r["peer"]) for r in doc["rows"]] == [
        (s, impl, impl == "torch") for s in ("1f1b", "interleaved") for impl in ("fived", "torch")]
    assert all(r["optimizer_s"] is None for r in doc["rows"])  # no optimizer in this bench


def test_bench_cp_schema(capsys, monkeypatch):
    doc = bench_doc("cp", capsys, monkeypatch)
    modes = {r["implementation"]: r for r in doc["rows"] if r["variant"] == "attention"}
    assert set(modes) == {"ring", "ulysses", "allgather", "ring-contiguous"}
    assert [m for m, r in modes.items() if r["peer"]] == ["allgather"]
    assert all(r["bytes_sent"] > 0 for r in modes.values())


def test_bench_ep_schema(capsys, monkeypatch):
    doc = bench_doc("ep", capsys, monkeypatch)
    assert [(r["implementation"], r["peer"]) for r in doc["rows"]] == [
        ("fived ep1", True), ("fived ep2", False), ("loop", True), ("grouped", False)]
    ep1, ep2 = doc["rows"][:2]
    assert ep1["extra"]["loss_last"] == pytest.approx(ep2["extra"]["loss_last"], rel=1e-5)
    assert ep2["extra"]["expert_bytes_per_rank"] * 2 == ep1["extra"]["expert_bytes_per_rank"]


def test_bench_ep_grouped_matmul_schema(capsys, monkeypatch):
    """``--matmul-only``: grouped vs loop expert matmuls alone, one (loop, grouped) pair per
    experts-per-rank, loop the peer; the ratio is the paired median of the repetitions."""
    doc = bench_doc("ep", capsys, monkeypatch, ["--matmul-only", "--experts-per-rank", "8,32",
                                   "--matmul-reps", "3", "--matmul-iters", "1"])
    assert [(r["variant"], r["implementation"], r["peer"]) for r in doc["rows"]] == [
        ("experts 8", "loop", True), ("experts 8", "grouped", False),
        ("experts 32", "loop", True), ("experts 32", "grouped", False)]
    for r in doc["rows"]:
        assert len(r["extra"]["times_s"]) == 3 and r["extra"]["rows"] == 16 * r["extra"]["experts"]
    from fived.bench.ep import main

    assert main(["--matmul-only", "--matmul-reps", "0"]) == 2


def test_bench_data_schema(capsys, monkeypatch):
    doc = bench_doc("data", capsys, monkeypatch)
    trainer, sync, threaded = doc["rows"]
    assert trainer["peer"] and not sync["peer"] and not threaded["peer"]
    tokens = doc["settings"]["global_batch"] * doc["settings"]["seq_len"]
    for r in doc["rows"]:  # seconds per batch and tokens/s are one measurement
        assert r["step_s"] * r["extra"]["tokens_per_s"] == pytest.approx(tokens)
    # the bench's ratio (slower loader over the trainer, in tokens/s) is 1 / the slower row's
    assert doc["extra"]["ratio"] == pytest.approx(1 / max(sync["ratio"], threaded["ratio"]))


def test_bench_generate_schema(capsys, monkeypatch):
    pytest.importorskip("transformers")  # the peer
    doc = bench_doc("generate", capsys, monkeypatch)
    assert doc["extra"]["same_tokens"] is True
    assert [(r["variant"], r["implementation"], r["peer"]) for r in doc["rows"]] == [
        (v, impl, impl == "transformers") for v in ("prefill tp1", "decode tp1")
        for impl in ("transformers", "fived")]
