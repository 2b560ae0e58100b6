"""Every ``fived bench NAME --json`` prints one ``fived.bench`` v1 document (docs/benchmarks.md):
each bench run at a tiny size, its output validated. comm and ddp run in the default suite; the
heavier ones are slow-marked."""

import json
import math

import pytest

from fived.bench import schema


def _doc(capsys, text=None):
    out = capsys.readouterr().out if text is None else text
    last = out.strip().splitlines()[-1]
    doc = json.loads(last)
    schema.validate(doc)
    return doc


def _check_ratios(doc):
    peers = {r["variant"]: r for r in doc["rows"] if r["peer"]}
    for r in doc["rows"]:
        if r["variant"] in peers:
            assert math.isclose(r["ratio"], schema.ratio(r, peers[r["variant"]]))
        else:
            assert r["ratio"] is None


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


def test_bench_comm_schema(capsys):
    from fived.bench.comm import main

    assert main(["--nprocs", "2", "-b", "4K", "-e", "4K", "--ops", "all_reduce,all_gather",
                 "--iters", "2", "--warmup", "1", "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    schema.validate(doc)
    _check_ratios(doc)
    assert doc["bench"] == "comm" and doc["extra"]["world"] == 2
    assert {(r["variant"], r["implementation"]) for r in doc["rows"]} == {
        (f"{op} 4K", impl) for op in ("all_reduce", "all_gather") for impl in ("backend", "ring")}
    for r in doc["rows"]:  # the ring and the backend charge the same bytes here (4K / 2)
        assert r["bytes_sent"] == r["extra"]["bus_bytes"] and r["state_bytes"] is None


TINY = ["--nprocs", "2", "--hidden", "32", "--layers", "1", "--seq-len", "16", "--reps", "2",
        "--steps", "1", "--warmup", "1", "--json"]


def test_bench_ddp_schema(capsys):
    from fived.bench.ddp import main

    assert main(TINY) == 0
    doc = _doc(capsys)
    _check_ratios(doc)
    by = {r["implementation"]: r for r in doc["rows"]}
    assert set(by) == {"fived DDP", "fived DDP no-overlap", "torch DDP"}
    assert by["torch DDP"]["peer"] and by["torch DDP"]["ratio"] == 1.0
    # same model states on both sides, the optimizer timed on both, the same first loss
    assert by["fived DDP"]["state_bytes"] == by["torch DDP"]["state_bytes"]
    assert all(r["optimizer_s"] > 0 for r in doc["rows"])
    assert len({r["extra"]["first_loss"] for r in doc["rows"]}) == 1
    assert by["fived DDP"]["bytes_sent"] > 0 and by["torch DDP"]["bytes_sent"] is None


@pytest.mark.slow
def test_bench_zero_schema(capsys):
    from fived.bench.zero import main

    assert main(TINY) == 0
    doc = _doc(capsys)
    _check_ratios(doc)
    by = {r["implementation"]: r for r in doc["rows"]}
    assert by["torch FSDP2"]["peer"]
    assert by["fived ZeRO-3"]["state_bytes"] == by["torch FSDP2"]["state_bytes"]
    assert all(r["optimizer_s"] > 0 for r in doc["rows"])


@pytest.mark.slow
def test_bench_tp_schema(capsys):
    from fived.bench.tp import main

    assert main(["--model", "tiny", "--reps", "1", "--warmup", "0", "--batch", "2",
                 "--json"]) == 0
    doc = _doc(capsys)
    _check_ratios(doc)
    assert {r["variant"] for r in doc["rows"]} == {"tp", "tp+sp"}
    for r in doc["rows"]:
        assert r["extra"]["grad_rel_gap"] < 1e-4 and r["optimizer_s"] > 0


@pytest.mark.slow
def test_bench_pp_schema(capsys):
    from fived.bench.pp import main

    assert main(["--pp", "2", "--micro-batches", "4", "--layers", "4", "--reps", "1",
                 "--global-batch", "4", "--json"]) == 0
    doc = _doc(capsys)
    _check_ratios(doc)
    assert {"gpipe", "1f1b", "interleaved"} <= {r["variant"] for r in doc["rows"]}


@pytest.mark.slow
def test_bench_cp_schema(capsys):
    from fived.bench.cp import main

    assert main(["--cp", "2", "--seq", "64", "--heads", "4", "--kv-heads", "2", "--iters", "1",
                 "--warmup", "0", "--json"]) == 0
    doc = _doc(capsys)
    _check_ratios(doc)
    assert any(r["implementation"] == "allgather" and r["peer"] for r in doc["rows"])


@pytest.mark.slow
def test_bench_ep_schema(capsys):
    from fived.bench.ep import main

    assert main(["--eps", "1,2", "--steps", "2", "--global-batch", "4", "--experts-per-rank",
                 "8", "--matmul-reps", "2", "--matmul-iters", "1", "--json"]) == 0
    doc = _doc(capsys)
    _check_ratios(doc)
    assert [r["implementation"] for r in doc["rows"]] == ["fived ep1", "fived ep2", "loop",
                                                          "grouped"]


def test_bench_ep_grouped_matmul_schema(capsys):
    """``--matmul-only``: grouped vs loop expert matmuls alone, one (loop, grouped) pair per
    experts-per-rank, loop the peer; the ratio is the paired median of the repetitions."""
    from fived.bench.ep import main

    assert main(["--matmul-only", "--experts-per-rank", "8,32", "--matmul-reps", "3",
                 "--matmul-iters", "1", "--json"]) == 0
    doc = _doc(capsys)
    _check_ratios(doc)
    assert [(r["variant"], r["implementation"], r["peer"]) for r in doc["rows"]] == [
        ("experts 8", "loop", True), ("experts 8", "grouped", False),
        ("experts 32", "loop", True), ("experts 32", "grouped", False)]
    for r in doc["rows"]:
        assert len(r["extra"]["times_s"]) == 3 and r["extra"]["rows"] == 16 * r["extra"]["experts"]
    assert main(["--matmul-only", "--matmul-reps", "0"]) == 2
