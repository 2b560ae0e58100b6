"""The figures' numbers, checked against the ledger or the run they came from (not pixels).

Default suite: the ledger-only overview, the schedule Gantt data, the collective diagrams,
the ZeRO part (two ranks, seconds), parts 8 and 9 at their ``--quick`` size (the numerics
experiments in one process, the optimizers on two ranks: seconds) and their page, checked with
``html.parser``, the files each figure writes. ``slow``: every other part
at its ``--quick`` size, and ``fived figures all --quick``.
"""

from __future__ import annotations

import base64
import json
import math
import re
import statistics
from html.parser import HTMLParser

import pytest

from fived.config import PRESETS, ModelConfig, ParallelConfig


def quiet(_text: str) -> None:
    pass


def by_name(figs):
    return {f.name: f for f in figs}


# ------------------------------------------------------------------ overview: the ledger
def test_overview_numbers_are_the_ledger(tmp_path):
    from fived.ledger import compute, memory
    from fived.ledger.hardware import PRESETS as HW
    from fived.ledger.params import total_params
    from fived.ledger.planner import predict
    from fived.ranks.grid import Grid
    from fived.viz import overview as overview_module
    from fived.viz._fig import save

    figs = by_name(overview_module.figures(True, quiet))
    psi = figs["overview-16psi"].data
    assert psi["per_param"]["bf16"]["total"] == 16 and psi["per_param"]["fp32"]["total"] == 18
    for name in overview_module.MODELS:
        p = total_params(PRESETS[name])
        m = psi["models"][name]
        assert m["params"] == p
        assert m["bf16"]["total"] == 16 * p and m["fp32"]["total"] == 18 * p
        assert m["fp32"]["grads"] == 4 * p and m["bf16"]["grads"] == 2 * p
    assert psi["devices"]["h100-sxm"] == HW["h100-sxm"].memory

    walls = figs["overview-walls"].data
    for name, mem in walls["memory"].items():
        p = total_params(PRESETS[name])
        assert mem["unsharded"] == 16 * p
        assert mem["zero3"]["64"] == pytest.approx(16 * p / 64)
        assert walls["time_s"][name]["8"] == pytest.approx(
            compute.training_flops(p, 20 * p) / (8 * HW["h100-sxm"].peak_flops))

    mp = figs["overview-map"].data["rows"]
    assert mp["dp"]["states_ratio"] == pytest.approx(1 / 8, rel=0.01)  # ZeRO-3 over 8
    # cp8 cuts the sequence by 8; in bf16 the ring also saves fp32 copies of K/V (the ledger's
    # cp_ring term, found by the dry run), so the activations fall to a bit more than 1/8
    assert 1 / 8 <= mp["cp"]["activations_ratio"] < 1 / 6
    assert "all_reduce" in mp["tp"]["collectives"] and "all_to_all" in mp["ep"]["collectives"]

    grid = figs["overview-grid"].data
    g = Grid.from_config(overview_module.GRID_LAYOUT)
    for dim, groups in grid["groups"].items():
        assert [tuple(x) for x in groups] == g.partition((dim,))
        assert grid["crosses_node"][dim] == g.crosses_node((dim,), overview_module.GRID_GPN)

    iron = figs["overview-iron"].data
    ov = overview_module
    p = predict(PRESETS[ov.IRON_MODEL], ov.IRON_LAYOUT, HW[ov.IRON_HW], ov.IRON_GLOBAL_BATCH)
    assert iron["traffic"] == p.traffic
    for grp, v in iron["groups"].items():
        assert v["bytes"] == pytest.approx(p.traffic[grp])
    assert memory.bytes_per_param(ParallelConfig(precision="bf16", grad_reduce_dtype="bf16")) == 16

    rec = save(figs["overview-grid"], str(tmp_path), "fived figures overview --out X")
    assert (tmp_path / "overview-grid.png").stat().st_size > 1000
    assert (tmp_path / "overview-grid.svg").read_text().lstrip().startswith("<?xml")
    back = json.loads((tmp_path / "overview-grid.json").read_text())
    assert back == json.loads(json.dumps(rec)) and back["command"] == "fived figures overview --out X"
    assert back["source"] == "ledger" and back["data"]["world"] == 8


def test_gantt_data_is_the_schedule():
    from fived import schedules
    from fived.viz.bubbles import gantt_data

    p, m = 4, 8
    d = gantt_data(p, m)
    # the textbook bubbles (unit forward, backward 2 units, or B = W = 1 for zero bubble)
    textbook = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
                "interleaved": (p - 1) / (2 * m + p - 1), "zb-h1": (p - 1) / (3 * m + p - 1)}
    for name, g in d["schedules"].items():
        sched = schedules.build(name, p, m, g["v"])
        t = schedules.simulate(sched)
        assert g["bubble"] == t.bubble_fraction() and g["makespan"] == t.makespan
        assert g["formula"] == schedules.bubble_formula(name, p, m, g["v"])
        if name in textbook:
            assert g["formula"] == pytest.approx(textbook[name]), name
        # every forward of every micro-batch of every stage is drawn
        f = sum(1 for spans in g["spans"] for s in spans if s[0] == "F")
        assert f == m * p * g["v"]
        # the bubble is what the drawing leaves idle: every rank does 3 units of work per
        # micro-batch and chunk, no two of its spans overlap, all end by the makespan
        for spans in g["spans"]:
            ivs = sorted((s[3], s[4]) for s in spans)
            assert all(a[1] <= b[0] for a, b in zip(ivs, ivs[1:])) and ivs[-1][1] <= g["makespan"]
            busy = sum(b - a for a, b in ivs)
            assert busy == 3 * m * g["v"], name
            assert g["bubble"] == pytest.approx(1 - busy / g["makespan"]), name


def test_every_size_the_parts_run_is_valid():
    """The full-size layouts are valid before anything runs (a bad one fails the 10-min run)."""
    from fived import schedules
    from fived.config import validate
    from fived.viz import bubbles

    for quick in (True, False):
        c = bubbles.setup(quick)
        for name in schedules.NAMES:
            for m in bubbles.ms_for(name, c):
                par = bubbles.par_for(name, c["pp"], m)
                schedules.check(schedules.build(name, c["pp"], m, par.virtual_stages))
                assert max(c["ms"]) % m == 0  # the global batch splits into m micro-batches
                validate(ModelConfig(layers=2 * c["pp"]), par)


# ------------------------------------------------------------------ runs
def test_collective_diagrams_are_what_ran():
    from fived.comm.volume import bytes_sent
    from fived.viz.collectives import diagrams

    n = 2
    d = diagrams(n)["ops"]
    ins = d["all_reduce"]["input"]
    total = [sum(r[c] for r in ins) for c in range(n)]
    assert all(o == total for o in d["all_reduce"]["output"])
    assert all(o == [10.0 * r for r in range(n)] for o in d["all_gather"]["output"])
    assert [o for o in d["reduce_scatter"]["output"]] == [[total[r]] for r in range(n)]
    assert d["all_to_all"]["output"] == [[10.0 * s + r for s in range(n)] for r in range(n)]
    assert all(o == d["broadcast"]["input"][0] for o in d["broadcast"]["output"])
    assert d["reduce"]["output"][0] == total
    assert [o for o in d["scatter"]["output"]] == [[float(r)] for r in range(n)]
    assert d["gather"]["output"][0] == [10.0 * r for r in range(n)]
    s = 4 * n  # n float32
    assert d["all_reduce"]["bytes"] == [bytes_sent("all_reduce", s, n)] * n
    assert d["broadcast"]["bytes"] == [bytes_sent("broadcast", s, n), 0.0]


def test_zero_memory_and_traffic_equal_the_ledger():
    from fived.viz import zero

    figs = by_name(zero.figures(True, quiet))
    rows = figs["zero-memory"].data["rows"]
    assert {(r["dp"], r["zero"]) for r in rows} == {(dp, z) for dp in (1, 2) for z in range(4)}
    for r in rows:
        assert r["measured"] == r["ledger"], r  # to the byte, as `fived ledger --check`
        assert r["measured_bytes"] == r["ledger_bytes"], r
    dp2 = {r["zero"]: r for r in rows if r["dp"] == 2}
    one = {r["zero"]: r for r in rows if r["dp"] == 1}
    # stage 1 halves master + Adam, stage 2 also grads, stage 3 also params (dp = 2; padding
    # makes a shard at most a few elements more than half)
    assert dp2[1]["measured"]["optimizer"] <= one[1]["measured"]["optimizer"] / 2 + 64
    assert dp2[2]["measured"]["grads"] <= one[2]["measured"]["grads"] / 2 + 64
    assert dp2[3]["measured"]["params"] <= one[3]["measured"]["params"] / 2 + 64
    # stage 3 sends two gathers of each block and one of the root (it stays gathered from its
    # forward to its backward) and a reduce-scatter: (3Ψ − Ψ_root)/(2Ψ) of stage 0's all-reduce
    from fived.model import build_model

    model = build_model(zero.MODEL, 0)
    psi = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    assert dp2[3]["measured_bytes"] == pytest.approx(
        (3 * psi - root) / (2 * psi) * dp2[0]["measured_bytes"], rel=0.01)


# ------------------------------------------------------------------ parts 8 and 9: numerics, optimizers
NEW_PARTS = {"numerics": ["numerics-masters", "numerics-moments", "numerics-reduce",
                          "numerics-fp16", "numerics-fp8"], "optimizers": ["optimizers-layouts"]}


class PageChecker(HTMLParser):
    """Well-formed HTML (every non-void tag closed in order), and what the page holds: the h2
    section ids and titles, each h3 id, each <img> (its alt, its src, the <figure> it sits in)
    and each <figcaption>'s text."""

    VOID = {"meta", "img", "br", "hr", "link", "input", "source", "wbr"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors = [], []
        self.sections, self.h3, self.imgs, self.captions = {}, [], [], []
        self.figures = 0
        self._text: list[str] | None = None
        self._h2: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure":
            self.figures += 1
        if tag == "img":
            self.imgs.append({"alt": a.get("alt"), "src": a.get("src") or "",
                              "in_figure": "figure" in self.stack})
        elif tag == "h2":
            self._h2, self._text = a.get("id"), []
        elif tag == "h3":
            self.h3.append(a.get("id"))
        elif tag == "figcaption":
            self._text = []
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()
        if tag == "h2":
            self.sections[self._h2] = "".join(self._text)
            self._text = None
        elif tag == "figcaption":
            self.captions.append("".join(self._text))
            self._text = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


def check_page(text: str) -> PageChecker:
    p = PageChecker()
    p.feed(text)
    p.close()
    assert not p.errors and p.stack == [], (p.errors, p.stack)
    for img in p.imgs:
        assert img["alt"] and img["in_figure"], img
        head = "data:image/png;base64,"
        assert img["src"].startswith(head), img["src"][:40]
        assert base64.b64decode(img["src"][len(head):])[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(p.captions) == p.figures >= len(p.imgs)  # a figure shown as a table too
    # a reader's page: a stylesheet, a summary first, no JSON paths outside the folded record
    assert "<style>" in text and "font:16px/1.55 system-ui" in text
    assert list(p.sections)[0] == "summary" and list(p.sections)[-1] == "made"
    outside = re.sub(r"<pre>.*?</pre>", "", text, flags=re.S)
    assert not re.search(r"\w\[\d+\]\.\w", outside), re.search(r".{30}\w\[\d+\]\.\w.{30}",
                                                                  outside)
    return p


def reduce_errors(settings: dict, dps: tuple[int, ...]) -> list[dict]:
    """Part 8's reduce experiment at each of ``dps``, from scratch: the bench's model and global
    batch of 16 sequences cut into dp parts, each part's gradient of its summed token loss over
    all the batch's tokens (the parts sum to the whole batch's gradient: checked), and the
    relative errors of summing the parts in bf16 (rounding after each hop, in ring order), of
    rounding the inputs alone, and of summing in fp32 -- against the float64 sum."""
    import torch

    from fived.bench import numerics as numerics_bench
    from fived.model.llama import build_model
    from fived.train.data import global_batch

    m, seed = numerics_bench.model_cfg(settings["layers"]), numerics_bench.train_cfg(1, settings["lr"]).seed
    model = build_model(m, seed)
    x, y = global_batch(0, seed, 16, m.seq_len)
    pos, tokens = torch.arange(m.seq_len), x.numel()

    def grad(rows):
        model.zero_grad()
        (model(x[rows], pos, y[rows]) / tokens).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    whole = grad(slice(None)).double()
    out = []
    for dp in dps:
        n = 16 // dp
        parts = [grad(slice(i * n, (i + 1) * n)) for i in range(dp)]
        exact = sum(p.double() for p in parts)
        assert float((exact - whole).norm()) < 1e-6 * float(whole.norm())

        sums = {"bf16_input_only": sum(p.to(torch.bfloat16).double() for p in parts)}
        for key, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            acc = parts[0].to(dtype)
            for p in parts[1:]:
                acc = (acc.float() + p.to(dtype).float()).to(dtype)
            sums[key] = acc.double()
        out.append({k: float((v - exact).norm() / exact.norm()) for k, v in sums.items()})
    return out


def test_numerics_and_optimizers_parts_and_their_page(tmp_path):
    """Parts 8 and 9 through `fived figures all --quick --parts numerics,optimizers`: each figure
    writes PNG + SVG + JSON + command, its numbers are the bench experiment's (re-measured here,
    or checked against the ledger and the rule they measure), and the page has both sections."""
    from fived.bench import numerics as numerics_bench
    from fived.cli.main import main
    from fived.config import OPTIMIZERS
    from fived.ledger.memory import model_states
    from fived.viz import numerics as numerics_figure

    figs = tmp_path / "figs"
    assert main(["figures", "all", "--out", str(figs), "--quick", "--parts",
                 "numerics,optimizers"]) == 0
    index = json.loads((figs / "index.json").read_text())
    assert [r["name"] for r in index["figures"]] == [n for ns in NEW_PARTS.values() for n in ns]
    recs = {}
    for r in index["figures"]:
        for ext in ("png", "svg", "json"):
            assert (figs / f"{r['name']}.{ext}").stat().st_size > 1000
        rec = json.loads((figs / f"{r['name']}.json").read_text())
        assert rec == r and rec["command"] == f"fived figures {r['part']} --out {figs} --quick"
        exp = rec["name"].split("-")[1] if r["part"] == "numerics" else "optimizers"
        assert rec["data"]["settings"] == numerics_figure.settings(exp, True)
        assert rec["table"] == json.loads(json.dumps(
            [numerics_bench.HEADERS[exp],
             *numerics_bench.RUN[exp][1](rec["data"]["result"])]))  # the bench's rows
        recs[exp] = rec["data"]
    model = ModelConfig(**recs["masters"]["model"])
    assert model.layers == 1
    # fp8: every recipe trained the same steps as bf16, close to it; the outlier ruins the
    # per-tensor and per-row scales, not the 1×128 tiles
    f8 = recs["fp8"]["result"]
    ref = f8["runs"]["none"]["loss"]
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        got = f8["runs"][recipe]["loss"]
        assert len(got) == len(ref) and max(abs(a - b) for a, b in zip(got, ref)) < 0.05
    o = f8["outliers"]
    assert max(o[k]["error"][0] for k in o if k != "outlier") < 0.05  # no outlier: e4m3 alone
    assert o["blockwise"]["error"][-1] < 0.5 < o["rowwise"]["error"][-1] <= \
        o["tensorwise"]["error"][-1]

    ma = recs["masters"]["result"]
    for mode, v in ma.items():  # the engine's master bytes are the ledger's
        assert len(v["loss"]) == len(v["lost_fraction"]) == 4
        want = model_states(model, ParallelConfig(precision="bf16", master_weights=mode))
        assert v["master_bytes"] == want["master"], mode
    assert ma["fp32"]["master_bytes"] == 2 * ma["kahan"]["master_bytes"] > 0
    assert max(ma["none"]["lost_fraction"]) > max(ma["kahan"]["lost_fraction"])
    mo = recs["moments"]["result"]
    assert max(mo["fp32"]["m_lost"]) == max(mo["fp32"]["v_lost"]) == 0.0
    assert max(mo["bf16"]["v_lost"]) > 0.0 and max(mo["fp16"]["v_underflow"]) > 0.0

    red = recs["reduce"]["result"]
    assert red["dp"] == [1, 2, 4, 8, 16] and red["fp32"][0] == 0.0
    for i, got in enumerate(reduce_errors(recs["reduce"]["settings"], (1, 2, 4))):
        for key, v in got.items():  # the errors, measured again here from the gradients
            assert red[key][i] == pytest.approx(v, rel=1e-6, abs=1e-12), (key, red["dp"][i])
    # one part: one rounding to bf16 (8 significant bits), within the unit roundoff 2^-9
    assert red["bf16"][0] == red["bf16_input_only"][0] and 0 < red["bf16"][0] <= 2.0 ** -9
    assert all(f < 1e-6 < b for f, b in zip(red["fp32"], red["bf16"]))
    assert red["bf16"][-1] > red["bf16"][0]

    f16 = recs["fp16"]["result"]
    assert f16["scale"][0] == 2.0 ** 24 and len(f16["scale"]) == 6
    for i in range(5):  # overflow ⇔ skipped ⇔ the next scale halves (no 5 clean steps yet)
        assert (f16["overflow"][i] > 0) == f16["skipped"][i]
        assert f16["scale"][i + 1] == f16["scale"][i] / (2 if f16["skipped"][i] else 1)

    op = recs["optimizers"]
    assert set(op["result"]) == set(op["layouts"]) == set(numerics_bench.LAYOUTS)
    for lay, per in op["result"].items():
        par = ParallelConfig(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in op["layouts"][lay].items()})  # JSON: lists
        assert par == numerics_bench.LAYOUTS[lay]
        assert set(per) == set(OPTIMIZERS)
        for o, v in per.items():  # measured bytes and state equal the ledger's, to the byte
            assert v["bytes"] == v["ledger_bytes"] > 0, (lay, o)
            assert v["state_bytes"] == model_states(model, par, optimizer=o)["optimizer"]
            assert v["seconds"] > 0
        assert per["adamw"]["extra_bytes"] == 0

    out = tmp_path / "page"
    assert main(["report", "--out", str(out), "--from", str(figs), "--parts",
                 "numerics,optimizers"]) == 0
    text = (out / "index.html").read_text()
    p = check_page(text)
    assert p.sections["part-numerics"].startswith("Part 8")
    assert p.sections["part-optimizers"].startswith("Part 9")
    assert p.h3 == [n for ns in NEW_PARTS.values() for n in ns]
    assert [i["alt"] for i in p.imgs] == [r["title"] for r in index["figures"]]
    for cap, r in zip(p.captions, index["figures"]):
        assert r["command"] in cap and r["source"] in cap
    assert "http://" not in text and "https://" not in text and "<script" not in text
    assert "<th>optimizer</th>" in text and "<th>skipped</th>" in text  # the bench's tables


def test_the_series_is_every_part():
    from fived.viz._fig import PARTS
    from fived.viz._page import PART_TITLES
    from fived.viz.all import parse_parts

    assert parse_parts("") == list(PARTS) and PARTS[-3:] == ("numerics", "optimizers", "memory")
    assert [PART_TITLES[p].split(" —")[0] for p in PARTS[1:]] == [
        f"Part {i}" for i in range(1, 11)]


# ------------------------------------------------------------------ the command and the page
def test_figures_all_and_report_page(tmp_path, capsys):
    from fived.cli.main import main
    from fived.viz._page import PART_TITLES

    figs = tmp_path / "figs"
    assert main(["figures", "all", "--out", str(figs), "--quick", "--parts", "overview"]) == 0
    index = json.loads((figs / "index.json").read_text())
    assert [r["name"] for r in index["figures"]] == [
        "overview-16psi", "overview-walls", "overview-map", "overview-grid", "overview-iron"]
    for r in index["figures"]:
        for ext in ("png", "svg", "json"):
            assert (figs / f"{r['name']}.{ext}").exists()
        assert r["command"].startswith("fived figures overview --out")
    out = tmp_path / "page"
    assert main(["report", "--out", str(out), "--from", str(figs), "--parts", "overview"]) == 0
    page = (out / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 4  # the 5D map is a table
    p = check_page(page)
    assert p.sections["part-overview"] == PART_TITLES["overview"]
    assert list(p.sections) == ["summary", "part-overview", "made"]
    assert p.h3[2] == "overview-map" and "<th>collectives (ledger)</th>" in page
    assert "5 figures in 1 parts" in page and "5 computed by the ledger" in page
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert "fived figures overview --out" in page
    assert "report" in capsys.readouterr().out


def test_report_layout_and_bad_input(tmp_path, capsys):
    """The one-layout page (its figures, tables and summary), --measure, and bad input.

    Time: two pages each run the planner for their alternatives, and --measure trains two
    gloo ranks for two steps."""
    from fived.cli.main import main
    from fived.ranks.grid import Grid

    out = tmp_path / "lay"
    assert main(["report", "--out", str(out), "--tp", "2", "--pp", "2", "--dp", "2",
                 "--gpus-per-node", "4"]) == 0
    page = (out / "index.html").read_text()
    p = check_page(page)
    # memory per rank, the schedule, the traffic per group as figures; the grid a table
    assert p.h3 == ["layout-memory", "layout-schedule", "layout-iron", "layout-grid",
                    "layout-traffic", "layout-alternatives"]
    assert page.count("data:image/png") == 3
    g = Grid.from_config(ParallelConfig(tp=2, pp=2, dp=2))
    for d in ("tp", "pp", "dp"):  # every group of the grid, as the page lists it
        groups = "; ".join("{" + ", ".join(map(str, m)) + "}" for m in g.partition((d,)))
        assert f"<b>{d}</b> (2): {groups}" in page
    assert "<th>node 1</th>" in page  # 4 GPUs per node: two rows
    mem = json.loads((out / "layout-memory.json").read_text())["data"]
    assert [r["pp_rank"] for r in mem["ranks"]] == [0, 1]
    assert mem["categories"][:3] == ["states", "activations", "buffers"]
    from fived.ledger.memory import FUSED, rank_memory
    from fived.ledger.peak import with_peak

    par = ParallelConfig(tp=2, pp=2, dp=2, precision="bf16")
    for r in mem["ranks"]:  # the ledger's bytes, stacked by its own categories
        want = rank_memory(PRESETS["tiny"], par, 16 // 2, r["pp_rank"], FUSED)
        assert r["total"] == want.total and r["activations"] == want.activations_total
        assert r["peak"] == with_peak(want, PRESETS["tiny"], par, 8, FUSED).peak > 0
    sched = json.loads((out / "layout-schedule.json").read_text())["data"]
    assert sched["bubble"] == 0.5  # 1F1B, p = 2, m = 1
    # the summary: fits, the peak, the step, where the time goes, what to change
    assert "fits</span>: the step peaks at" in page and "what to change" in page
    assert "the pipeline bubble is 50% of the step (pp 2, m = 1 micro-batches)" in page
    assert "The planner considered" in page
    assert re.search(r"This layout (would be number \d+ of the \d+ that fit|fits but is slower "
                     r"than these 5)\.", page)
    # --measure: a 2-step run of the layout, every rank's bytes equal to the ledger's
    out = tmp_path / "meas"
    assert main(["report", "--out", str(out), "--dp", "2", "--zero", "2", "--measure"]) == 0
    ranks = json.loads((out / "layout-measured.json").read_text())["data"]["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["measured_states"] == r["ledger_states"]
        assert r["measured_traffic"] == r["ledger_traffic"] and r["ledger_traffic"]["dense"] > 0
    bad = tmp_path / "bad"
    assert main(["report", "--out", str(bad), "--tp", "3"]) == 2
    assert not bad.exists()
    assert main(["figures", "all", "--parts", "bogus", "--out", str(bad)]) == 2
    assert not bad.exists()
    assert "ConfigError" in capsys.readouterr().err


# ------------------------------------------------------------------ slow: the other parts
@pytest.mark.slow
def test_bubbles_measured_is_the_run():
    from fived import schedules
    from fived.viz import bubbles

    d = by_name(bubbles.figures(True, quiet))["bubbles-measured"].data
    for name, rows in d["schedules"].items():
        for r in rows:
            per = r["per_rank_steps"]
            again = statistics.median(statistics.mean(p[k] for p in per)
                                      for k in range(1, len(per[0])))
            assert r["measured"] == again
            assert r["formula"] == schedules.bubble_formula(name, d["pp"], r["m"], r["v"])
            assert r["formula"] - 0.05 <= r["measured"] <= r["formula"] + 0.2, (name, r)


@pytest.mark.slow
def test_collectives_sweep_has_every_op():
    from fived.comm.bench import BENCH_OPS
    from fived.comm.volume import busbw_factor
    from fived.viz import collectives

    figs = by_name(collectives.figures(True, quiet))
    doc = figs["collectives-bandwidth"].data
    assert {"scatter", "gather"} <= set(doc["ops"]) and set(doc["ops"]) == set(BENCH_OPS)
    for r in doc["rows"]:
        assert r["busbw_GBps"] > 0 and math.isfinite(r["time_us"])
    fac = figs["collectives-factor"].data
    assert fac["ops"]["all_reduce"]["factor"] == busbw_factor("all_reduce", 2)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert all(x == pytest.approx(fac["ops"][op]["factor"], rel=0.01)
                   for x in fac["ops"][op]["recorded_over_S"]), op


@pytest.mark.slow
def test_ddp_and_fsdp_figures_are_the_runs():
    from fived.viz import ddp, fsdp

    d = by_name(ddp.figures(True, quiet))["ddp-step"].data["rank0"]
    assert set(d["step_s"]) == {"naive", "buckets", "buckets+overlap"}
    assert d["buckets"]["naive"] > d["buckets"]["buckets"] == d["buckets"]["buckets+overlap"] > 1
    for k, tl in d["timeline"].items():
        assert len(tl["buckets"]) == d["buckets"][k]
        assert all(e["launch"] <= e["done"] <= tl["finish_end"] + 1e-6 for e in tl["buckets"])
        if k == "buckets":  # no overlap: every launch after the backward
            assert all(e["launch"] >= tl["backward_end"] for e in tl["buckets"])
    ov = d["timeline"]["buckets+overlap"]
    assert ov["buckets"][0]["launch"] < ov["backward_end"]  # overlap: the first starts inside
    f = by_name(fsdp.figures(True, quiet))["fsdp-step"].data
    names = [r["name"] for r in f["rows"]]
    assert names == ["fived ZeRO-3", "torch FSDP1", "torch FSDP2"]
    assert all(r["step_s"] > 0 and r["state_bytes"] > 0 for r in f["rows"])
    pre = f["timeline"]["prefetch"]["events"]
    assert any(e["ahead"] for e in pre)
    assert not any(e["ahead"] for e in f["timeline"]["no-overlap"]["events"])


@pytest.mark.slow
def test_tensor_and_context_figures():
    from fived.viz import context, tensor

    t = by_name(tensor.figures(True, quiet))
    for r in t["tensor-bytes"].data["per_layer"]:
        assert r["measured"] == r["ledger"] > 0, r
    sh = t["tensor-shapes"].data["shapes"]
    assert sh[0]["q_proj"]["dim"] == 0 and sh[0]["o_proj"]["dim"] == 1
    assert sh[1]["down_proj"]["local"][1] * 2 == sh[1]["down_proj"]["global"][1]
    c = by_name(context.figures(True, quiet))
    z = c["context-zigzag"].data
    assert z["measured"] == z["ledger"]
    assert max(z["measured"]["zigzag"]) == min(z["measured"]["zigzag"])
    acts = c["context-activations"].data
    for name in ("tp", "ring CP"):
        for s in acts["seqs"]:
            assert acts["measured"][name][str(s)] == pytest.approx(
                acts["ledger"][name][str(s)], rel=0.01), (name, s)
