"""Weighted mixtures of sources (issue 41 item 5): ``--data code=DIR1:0.3,web=DIR2:0.7``.

The batch of a step is a pure function of (seed, step, sources, weights): the same rows
whatever reads them (any replica split, a resumed run), the realised proportions follow the
weights, each step's loss per source is right (against the step's loss and step 0 recomputed
source by source), and bad specs exit 2 naming ``--data``. Mutations seen to fail: every
source's tally booked to source 0; the tallies not reset between steps (step 1's "code" 57.6
against a step loss of 5.2)."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from doc_helpers import missing_file_exits_2, prepared, source_rows
from parity_helpers import check_parity, cli_exits_2, one_rank, run_cli, train_runs

from fived.config import ParallelConfig, preset
from fived.data.loader import MixtureLoader, open_loader
from fived.data.meta import Source, parse_mixture, read_data_meta
from fived.testing import small_train


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("mix")
    return prepared(base / "a", seed=1, long=40), prepared(base / "b", seed=2, short=30)


def spec(dirs, wa=0.3, wb=0.7):
    return f"code={dirs[0]}:{wa},web={dirs[1]}:{wb}"


def test_parse():
    assert parse_mixture("/some/dir") is None
    assert parse_mixture("a=/x:1,b=/y:3") == [Source("a", "/x", 1.0), Source("b", "/y", 3.0)]


def test_rows_are_a_pure_function_of_the_step_for_every_replica_split(dirs):
    kw = dict(seq_len=64, batch=8, seed=5)
    whole = open_loader(spec(dirs), "train", **kw)
    assert isinstance(whole, MixtureLoader)
    for step in (0, 3, 117):
        x, y = whole.global_batch(step)
        for n in (2, 4):
            parts = [open_loader(spec(dirs), "train", replica=r, replicas=n, **kw).batch(step)
                     for r in range(n)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x)
            assert torch.equal(torch.cat([p[1] for p in parts]), y)
        again = open_loader(spec(dirs), "train", **kw)  # a resumed run: nothing but the step
        assert all(torch.equal(a, b) for a, b in zip(again.global_batch(step), (x, y)))
    # each row is a window of the source the draw named
    src = whole.row_sources(3)
    x, _ = whole.global_batch(3)
    for j, k in enumerate(src.tolist()):
        toks = np.asarray(whole.parts[k].tokens)
        w = int(whole.parts[k].sequence_ids(3)[j])
        assert torch.equal(x[j], torch.from_numpy(toks[w * 64:w * 64 + 64].astype(np.int64)))


def test_realised_proportions_over_200_steps_follow_the_weights(dirs):
    ld = open_loader(spec(dirs), "train", seq_len=64, batch=16, seed=5)
    src = np.concatenate([ld.row_sources(s) for s in range(200)])
    share = float((src == 0).mean())
    # 3200 draws of p = 0.3: the standard deviation is 0.008
    assert abs(share - 0.3) < 0.03, share
    only_b = open_loader(spec(dirs, 0, 1), "train", seq_len=64, batch=16, seed=5)
    assert (np.concatenate([only_b.row_sources(s) for s in range(20)]) == 1).all()


def test_a_mixture_trains_the_same_on_dp2_as_on_one_rank(dirs):
    """Time: a one-rank and a dp2 run with evaluation (78 s under load: five workers shared
    the two cores)."""
    model = preset("tiny")
    from fived.data.meta import model_for_data

    model = model_for_data(model, spec(dirs))
    train = small_train(steps=3, data=spec(dirs), eval_every=3, eval_batches=1, doc_mask=True)
    ref = one_rank(model, train)
    out = train_runs([(model, ParallelConfig(dp=2), train)], timeout=600)[0]
    check_parity(out, ref, "dp2 mixture")

    def by_source(run):
        return [r["val_loss_by_source"] for r in run["ranks"][0]["history"]
                if "val_loss_by_source" in r]

    want = by_source(ref)
    assert len(want) == 2 and set(want[0]) == {"code", "web"}  # after step 0 and the last
    assert abs(want[-1]["code"] - want[-1]["web"]) > 1e-3  # two sources, two losses
    for got, w in zip(by_source(out), want):
        for k in w:
            assert abs(got[k] - w[k]) / w[k] < 1e-5, (k, got, w)
    # each step's training loss per source: the rows' means, weighted back to the step's loss
    for run in (ref, out):
        for r in run["ranks"][0]["history"]:
            by = r["loss_by_source"]
            rows = np.bincount(open_loader(spec(dirs), "train", seq_len=model.seq_len,
                                           batch=train.global_batch, seed=train.seed)
                               .row_sources(r["step"]), minlength=2)
            parts = [v * n for v, n in zip(by.values(), rows) if v is not None]
            assert abs(sum(parts) / rows.sum() - r["loss"]) < 1e-5 * r["loss"], (by, r["loss"])
    for a, b in zip(ref["ranks"][0]["history"], out["ranks"][0]["history"]):
        for k, v in a["loss_by_source"].items():
            assert v is None or abs(b["loss_by_source"][k] - v) < 1e-5 * v
    # step 0 recomputed here from the initial weights, source by source
    from fived.data.vocab import mask_padded_logits
    from fived.model.llama import build_model

    ld = open_loader(spec(dirs), "train", seq_len=model.seq_len, batch=train.global_batch,
                     seed=train.seed, documents=True)
    x, y, docs = ld.global_batch(0)
    net = build_model(model, train.seed)
    mask_padded_logits(net, 257, model.vocab)
    seen = 0
    for _, name, rows, pos, targets in source_rows(x, y, docs, model.seq_len, ["code", "web"]):
        with torch.no_grad():
            want = float(net(x[rows], pos, targets)) / (len(rows) * model.seq_len)
        got = ref["ranks"][0]["history"][0]["loss_by_source"][name]
        assert abs(got - want) < 1e-5 * want, (name, got, want)
        seen += 1
    assert seen == 2  # step 0 drew from both sources


def test_a_mixture_with_multi_token_prediction_at_cp2_equals_one_rank(dirs):
    """Multi-token prediction on a mixture with ``--eos-target ignore``: the targets carry both
    marks through cp's fetch of the targets ahead (``fived.model.mtp``). cp2 equals one rank
    (the trunk's losses, each module's, every gradient), and each step's per-source losses,
    weighted by the rows drawn, are the trunk's loss (the modules' are not tallied)."""
    from fived.data.meta import model_for_data

    model = replace(model_for_data(preset("tiny"), spec(dirs)), mtp_depth=1)
    train = small_train(steps=2, data=spec(dirs), eos_target="ignore")
    ref = one_rank(model, train)
    out = train_runs([(model, ParallelConfig(cp=2), train)], timeout=600)[0]
    check_parity(out, ref, "cp2 mixture mtp")
    for a, b in zip(ref["ranks"][0]["history"], out["ranks"][0]["history"]):
        assert abs(a["mtp_losses"][0] - b["mtp_losses"][0]) < 1e-5 * a["mtp_losses"][0]
        rows = np.bincount(open_loader(spec(dirs), "train", seq_len=model.seq_len,
                                       batch=train.global_batch, seed=train.seed)
                           .row_sources(a["step"]), minlength=2)
        for r in (a, b):
            parts = [v * n for v, n in zip(r["loss_by_source"].values(), rows) if v is not None]
            assert abs(sum(parts) / rows.sum() - r["loss"]) < 1e-5 * r["loss"], r


def test_the_toml_data_table_is_the_flag(dirs, tmp_path):
    """A ``[data]`` table in ``--config`` trains the mixture ``--data`` names: the resolved
    configuration (``--print-config``) is the flag's, key for key."""
    toml = tmp_path / "mix.toml"
    toml.write_text(f'[data]\ncode = {{ dir = "{dirs[0]}", weight = 0.3 }}\n'
                    f'web = {{ dir = "{dirs[1]}", weight = 0.7 }}\n')
    by_table = run_cli("train", "--config", str(toml), "--print-config")
    by_flag = run_cli("train", "--data", spec(dirs), "--print-config")
    assert by_table.returncode == by_flag.returncode == 0, by_table.stderr + by_flag.stderr
    assert f'data = "{spec(dirs)}"' in by_table.stdout, by_table.stdout
    assert by_table.stdout.replace(str(toml), "") == by_flag.stdout.replace(str(toml), "")
    both = tmp_path / "both.toml"
    both.write_text(f'[train]\ndata = "{dirs[0]}"\n' + toml.read_text())
    err = cli_exits_2(["train", "--config", str(both), "--metrics-out", str(tmp_path / "m")],
                      "[data]", tmp_path / "m")
    assert "keep one" in err


def test_the_checkpoint_state_names_the_mixture(dirs):
    st = open_loader(spec(dirs), "train", seq_len=64, batch=8, seed=5).state(4)
    other = open_loader(spec(dirs, 0.5, 0.5), "train", seq_len=64, batch=8, seed=5).state(4)
    assert st["source"] == "mixture" and st["next_step"] == 4
    assert st["data_hash"] != other["data_hash"]  # other weights: other batches, refused
    json.dumps(st)


@pytest.mark.parametrize("bad,words", [
    ("code={a}:x,web={b}:1", "weight 'x'"),
    ("code={a}:0,web={b}:0", "sum to zero"),
    ("code={a}:-1,web={b}:1", ">= 0"),
    ("code={a}", "NAME=DIR:WEIGHT"),
    ("code={a}:1,web={missing}:1", "no such directory"),
])
def test_bad_mixtures_exit_2(dirs, tmp_path, bad, words):
    s = bad.format(a=dirs[0], b=dirs[1], missing=tmp_path / "nope")
    err = cli_exits_2(["train", "--data", s, "--steps", "1", "--nprocs", "1", "--metrics-out",
                       str(tmp_path / "m")], "--data", tmp_path / "m")
    assert words in err, err


def test_a_source_with_another_tokenizer_is_refused(dirs, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(dirs[1], other)
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer"]["hash"] = "0" * 64
    (other / "meta.json").write_text(json.dumps(meta))
    err = cli_exits_2(["train", "--data", f"code={dirs[0]}:1,web={other}:1", "--steps", "1",
                       "--nprocs", "1", "--metrics-out", str(tmp_path / "m")], "--data",
                      tmp_path / "m")
    assert "another tokenizer" in err
    assert read_data_meta(spec(dirs))["mixture"][1]["name"] == "web"


def test_a_missing_token_file_is_refused(dirs, tmp_path):
    missing_file_exits_2(dirs[0], "train.bin", tmp_path)


def test_fived_eval_of_a_mixture_gives_the_runs_losses_per_source(dirs, tmp_path):
    """``fived eval --data MIXTURE`` of a ``--doc-mask`` checkpoint: the run's last validation
    loss and per-source losses (the checkpoint's document masks carried into evaluation).

    Time: a one-rank training run with a save, and the evaluation (in-process)."""
    m, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    r = run_cli("train", "--data", spec(dirs), "--doc-mask", "--steps", "2", "--nprocs", "1",
                "--eval-every", "2", "--eval-batches", "1", "--save-dir", str(ck),
                "--metrics-out", str(m))
    assert r.returncode == 0, r.stderr
    last = [json.loads(x) for x in m.read_text().splitlines() if "val_loss" in x][-1]
    r = run_cli("eval", "--from", str(ck), "--data", spec(dirs), "--batches", "1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert abs(doc["loss"] - last["val_loss"]) < 1e-5 * last["val_loss"], (doc, last)
    for k, v in last["val_loss_by_source"].items():
        assert abs(doc["loss_by_source"][k] - v) < 1e-5 * v, (doc, last)
