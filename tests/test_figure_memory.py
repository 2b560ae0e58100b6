"""``fived figures memory``: the ledger's stack is ``step_phases``, the line is the dry run, the
peaks are marked where the maxima are (checked on the drawn artists, not only the JSON)."""

from __future__ import annotations

import json

import pytest

from fived.config import ParallelConfig, TrainConfig, preset

TINY_PP2 = ["--model", "tiny", "--pp", "2", "--micro-batches", "2", "--global-batch", "4",
            "--precision", "fp32"]


def run_cli(args, tmp_path, capsys):
    from fived.cli.main import main

    out = tmp_path / "figs"
    rc = main(["figures", "memory", *args, "--out", str(out)])
    return rc, out, capsys.readouterr()


def only_record(out):
    recs = [json.loads(p.read_text()) for p in sorted(out.glob("memory-*.json"))]
    assert len(recs) == 1
    for ext in ("png", "svg"):
        assert (out / f"{recs[0]['name']}.{ext}").stat().st_size > 0
    return recs[0]


def check_ledger(d, m, par, gb, pp_rank):
    """The stack sums to ``step_phases`` phase by phase; the kept part is ``model_states``."""
    from fived.ledger.memory import model_states
    from fived.ledger.peak import step_input_bytes, step_phases
    from fived.ledger.traffic import micro_batch_size

    phases = step_phases(m, par, micro_batch_size(par, gb), pp_rank)
    led = d["ledger"]
    assert led["phases"] == [p.name for p in phases]
    sums = [sum(s["bytes"][i] for s in led["stack"]) for i in range(len(phases))]
    assert sums == pytest.approx([p.total for p in phases], rel=0, abs=1e-6)
    assert led["total"] == [p.total for p in phases]
    states = model_states(m, par, pp_rank)
    for k in ("params", "grads", "master", "optimizer"):
        s = next(s for s in led["stack"] if s["key"] == f"kept.{k}")
        assert s["bytes"] == [float(states[k])] * len(phases)
    inputs = next(s for s in led["stack"] if s["key"] == "kept.inputs")
    assert inputs["bytes"] == [step_input_bytes(m, par, micro_batch_size(par, gb))] * len(phases)
    assert [sum(s["bytes"][i] for s in led["stack"] if s["group"] == "kept")
            for i in range(len(phases))] == [p.kept for p in phases]
    saved = next(s for s in led["stack"] if s["key"] == "saved")
    assert saved["bytes"] == [p.saved for p in phases]
    for p_i, p in enumerate(phases):  # every transient by name, in its group
        for k, v in p.transients.items():
            s = next(s for s in led["stack"] if s["key"] == f"transient.{k}")
            assert s["bytes"][p_i] == v
            assert s["group"] == ("comm" if k in ("grad_recv", "sp_gather", "cp_ring", "ep_a2a",
                                                  "zero_buffers") else "compute")
    i = max(range(len(phases)), key=lambda j: phases[j].total)
    assert led["peak"]["index"] == i and led["peak"]["phase"] == phases[i].name
    assert led["peak"]["bytes"] == max(p.total for p in phases)
    return phases


def check_measured(d, rec):
    """The measured series is the dry run's, and its peak the run's step peak."""
    meas = d["measured"]
    assert meas["phases"] == rec["phases"]
    by_name = {p[0]: p[2] for p in rec["phases"]}
    assert meas["peak_by_phase"] == [by_name.get(n) for n in d["ledger"]["phases"]]
    assert meas["peak"]["bytes"] == rec["peak"] and meas["peak"]["phase"] == rec["peak_phase"]
    step = [v for v in meas["peak_by_phase"] if v is not None]
    assert max(step) == rec["peak"]  # the step's phases hold the peak (not build, not end)
    assert d["ledger"]["phases"][meas["peak"]["index"]] == rec["peak_phase"]


def check_markers(d):
    """Draw the figure again: the two peak annotations point at the maxima."""
    from fived.viz._fig import plt
    from fived.viz.memory import draw

    p = plt()
    f = p.figure()
    draw(d, f)
    ax = f.axes[0]
    marks = {a.get_gid(): a for a in ax.texts if a.get_gid()}
    led, meas, scale = d["ledger"], d["measured"], d["scale"]
    i = max(range(len(led["total"])), key=lambda j: led["total"][j])
    assert marks["ledger-peak"].xy == (i, pytest.approx(max(led["total"]) / scale))
    assert led["phases"][i] in marks["ledger-peak"].get_text()
    step = meas["peak_by_phase"]
    j = max((k for k, v in enumerate(step) if v is not None), key=lambda k: step[k])
    assert marks["measured-peak"].xy == (j, pytest.approx(step[j] / scale))
    assert led["phases"][j] in marks["measured-peak"].get_text()
    # the stacked bars reach the ledger's totals (the top of each bar is the phase's live bytes)
    tops: dict[float, float] = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2, 6)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    assert [tops[float(k)] for k in range(len(led["total"]))] == pytest.approx(
        [t / scale for t in led["total"]])
    p.close(f)


def test_memory_figure_pp2_default_rank(tmp_path, capsys):
    from fived.ledger.peak import largest_rank
    from fived.train.dryrun import dry_run_rank

    rc, out, io = run_cli(TINY_PP2, tmp_path, capsys)
    assert rc == 0, io.err
    rec = only_record(out)
    d = rec["data"]
    m, par = preset("tiny"), ParallelConfig(pp=2, dp=2, micro_batches=2, precision="fp32")
    assert d["layout"] == par.describe() == "pp2·dp2"  # dp takes what pp leaves of 4, as train
    top = largest_rank(m, par, 1).pp_rank
    assert d["rank"] == top * 2 and d["ledger"]["pp_rank"] == top  # coordinate 0 elsewhere
    check_ledger(d, m, par, 4, top)
    check_measured(d, dry_run_rank(m, par, TrainConfig(global_batch=4), d["rank"]))
    check_markers(d)
    assert rec["source"] == "ledger+run" and rec["command"].startswith("fived figures memory")
    # the closing table: ledger peak, dry-run peak, their difference and the phase
    lines = io.out.rstrip().splitlines()
    row = next(x for x in lines if x.startswith("pp2·dp2 "))
    from fived.ledger.memory import fmt_bytes

    assert fmt_bytes(d["ledger"]["peak"]["bytes"]) in row
    assert fmt_bytes(d["measured"]["peak"]["bytes"]) in row
    assert f"{d['peak_diff']['fraction']:+.2%}" in row and d["ledger"]["peak"]["phase"] in row
    assert d["peak_diff"]["bytes"] == d["measured"]["peak"]["bytes"] - d["ledger"]["peak"]["bytes"]
    table = lines[lines.index(next(x for x in lines if x.startswith("layout "))):]
    assert len(table) == 5 and max(len(x) for x in table) <= 80
    assert f"  {rec['name']}.png .svg .json" in lines


def test_memory_figure_named_rank_3d(tmp_path, capsys):
    """tp2·pp2·dp2 with ZeRO-2 (communication buffers), the rank named: pp 1, tp 1."""
    from fived.ledger.verify import coords
    from fived.train.dryrun import dry_run_rank

    args = ["--model", "tiny", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "2",
            "--micro-batches", "2", "--global-batch", "4", "--precision", "fp32", "--rank", "5"]
    rc, out, io = run_cli(args, tmp_path, capsys)
    assert rc == 0, io.err
    d = only_record(out)["data"]
    m = preset("tiny")
    par = ParallelConfig(tp=2, pp=2, dp=2, zero=2, micro_batches=2, precision="fp32")
    assert d["rank"] == 5 and coords(par, 5) == {**d["coords"]}
    assert d["ledger"]["pp_rank"] == coords(par, 5)["pp"] == 1
    phases = check_ledger(d, m, par, 4, 1)
    assert any(p.transients.get("zero_buffers") for p in phases)
    assert any(s["group"] == "comm" and any(s["bytes"]) for s in d["ledger"]["stack"])
    check_measured(d, dry_run_rank(m, par, TrainConfig(global_batch=4), 5))
    check_markers(d)


def test_memory_figure_bad_input(tmp_path, capsys):
    rc, out, io = run_cli([*TINY_PP2, "--rank", "4"], tmp_path, capsys)
    assert rc == 2 and "--rank 4" in io.err and not out.exists()
    rc, out, io = run_cli(["--model", "tiny", "--tp", "3"], tmp_path, capsys)
    assert rc == 2 and "ConfigError" in io.err and not out.exists()
    rc, out, io = run_cli(["--rank", "1"], tmp_path, capsys)  # a rank of which layout?
    assert rc == 2 and "--rank: name the layout" in io.err and not out.exists()
    rc, out, io = run_cli(["--print-config"], tmp_path, capsys)  # the series is two layouts
    assert rc == 2 and "small pp2 and small pp2·dp2·tp2" in io.err and not io.out


def test_memory_is_a_part_of_the_series():
    from fived.cli.main import modules
    from fived.viz import memory
    from fived.viz._fig import PARTS

    assert "memory" in PARTS and "memory" in modules("fived.viz")
    assert [p.describe() for p in memory.SERIES] == ["pp2", "pp2·dp2·tp2"]
    assert memory.SERIES_TRAIN.global_batch == 16
    d = {"model": "small", "layout": "pp2·dp2·tp2·zero2", "schedule": "1f1b",
         "recompute": "none", "rank": 4}
    assert memory.figure_name(d) == "memory-small-pp2-dp2-tp2-zero2-rank4"
    d.update(schedule="zb-v", recompute="full")  # no two layouts of one folder share a file
    assert memory.figure_name(d) == "memory-small-pp2-dp2-tp2-zero2-zb-v-recompute-full-rank4"


@pytest.mark.slow
def test_memory_in_figures_all_and_the_page(tmp_path):
    """``fived figures all --parts memory``: the series' two layouts of ``small``, each on its
    highest-peak rank, and their section of the page."""
    from fived.cli.main import main
    from fived.viz._page import PART_TITLES

    figs = tmp_path / "figs"
    assert main(["figures", "all", "--parts", "memory", "--out", str(figs)]) == 0
    index = json.loads((figs / "index.json").read_text())
    assert [r["name"] for r in index["figures"]] == ["memory-small-pp2-rank0",
                                                     "memory-small-pp2-dp2-tp2-rank0"]
    m = preset("small")
    for r, par in zip(index["figures"], [ParallelConfig(pp=2, micro_batches=4, precision="fp32"),
                                         ParallelConfig(tp=2, pp=2, dp=2, micro_batches=4,
                                                        precision="fp32")]):
        assert r["command"] == f"fived figures memory --out {figs}"
        check_ledger(r["data"], m, par, 16, r["data"]["ledger"]["pp_rank"])
    page = tmp_path / "page"
    assert main(["report", "--from", str(figs), "--parts", "memory", "--out", str(page)]) == 0
    text = (page / "index.html").read_text()
    assert text.count("data:image/png;base64,") == 2 and PART_TITLES["memory"].split(":")[0] in text
