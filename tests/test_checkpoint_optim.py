"""Checkpoints of every optimizer (--optimizer adamw|adafactor|muon|rownorm) and master-weights
mode (--master-weights fp32|none|sr|kahan): bit-exact resume on the same layout, resharding of
Adafactor's factored statistics and Muon's momentum to another layout. docs/checkpoints.md.

As in tests/test_checkpoint.py, one spawn trains many runs: the run that never stops, the run
that stops after ``K`` steps and saves, then (second spawn) the resumed runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fived.checkpoint.optimizer import matrix
from fived.config import PRESETS, ParallelConfig
from fived.testing import rel_diff, run_ranks, small_train

DENSE = PRESETS["tiny"]
K = 3
TRAIN = small_train(steps=5)
Z2 = ParallelConfig(dp=2, zero=2)
BF16 = dict(precision="bf16")
TP2 = ParallelConfig(tp=2, sequence_parallel=True)


def _losses(rank: int, world: int, runs: list) -> list[list[float]]:
    from fived.train.trainer import train_rank

    return [train_rank(rank, world, m, p, t, show=False)["losses"] for m, p, t in runs]


def _cases(tmp_path, cases: dict[str, tuple[ParallelConfig, str]], model=DENSE):
    """Per case: (straight, stop at K and save) runs, and the resumed run."""
    first, resumed = [], []
    for name, (par, opt) in cases.items():
        t = replace(TRAIN, optimizer=opt)
        d = str(tmp_path / name)
        first += [(model, par, t), (model, par, replace(t, stop_after=K, save_dir=d))]
        resumed.append((model, par, replace(t, resume=d)))
    return first, resumed


def _check_bit_exact(tmp_path, cases, reshard=(), model=None):
    """Every case of ``cases`` resumes bit for bit; each (case, layout) of ``reshard`` resumes
    the case's checkpoint under ``layout`` within 1e-5 of the straight run."""
    first, resumed = _cases(tmp_path, cases, model or DENSE)
    ref = run_ranks(_losses, 2, first, timeout=900)[0]
    names = list(cases)
    extra = [(model or DENSE, par, replace(TRAIN, optimizer=cases[name][1],
                                  resume=str(tmp_path / name))) for name, par in reshard]
    out = run_ranks(_losses, 2, resumed + extra, timeout=900)[0]
    for i, name in enumerate(names):
        full, stopped, rest = ref[2 * i], ref[2 * i + 1], out[i]
        assert stopped == full[:K], name
        assert len(rest) == TRAIN.steps - K, name
        assert stopped + rest == full, (name, full, stopped + rest)  # bit for bit
    for (name, par), got in zip(reshard, out[len(names):]):
        full = ref[2 * names.index(name)]
        assert rel_diff(got, full[K:]) < 1e-5, (name, par.describe(), got, full[K:])
    return ref


def _manifest(d):
    step = sorted(p for p in d.iterdir() if p.name.startswith("step-"))[-1]
    return json.loads((step / "manifest.json").read_text())


def test_every_optimizer_and_master_mode_resumes_bit_exact_and_reshards(tmp_path):
    """dp2·ZeRO-2: adafactor, muon, rownorm (fp32), adamw with --master-weights kahan and sr
    (bf16), and adafactor on tp2 (+SP) resume bit for bit; the dp2·ZeRO-2 adafactor and muon
    checkpoints resume under tp2 (+SP) within 1e-5. The checkpoints hold Adafactor's
    row/column statistics in global shapes (not per element), Muon's m and its AdamW v,
    Kahan's c, the SR generator."""
    cases = {
        "adafactor": (Z2, "adafactor"),
        "muon": (Z2, "muon"),
        "rownorm": (Z2, "rownorm"),
        "kahan": (replace(Z2, master_weights="kahan", **BF16), "adamw"),
        "sr": (replace(Z2, master_weights="sr", **BF16), "adamw"),
        "adafactor-tp2": (TP2, "adafactor"),
    }
    _check_bit_exact(tmp_path, cases, [("adafactor", TP2), ("muon", TP2)])
    shapes = {n: tuple(s) for n, s in _param_shapes().items()}
    t = _manifest(tmp_path / "adafactor")["tensors"]
    for n, s in shapes.items():
        rows, cols = matrix(s)
        assert t[f"optim.R.{n}"]["shape"] == [rows] and t[f"optim.C.{n}"]["shape"] == [cols]
    assert not any(k.startswith(("optim.m.", "optim.v.", "master.")) for k in t)
    t = _manifest(tmp_path / "muon")["tensors"]
    assert all(t[f"optim.m.{n}"]["shape"] == list(s) for n, s in shapes.items())
    assert sorted(k[8:] for k in t if k.startswith("optim.v.")) == sorted(
        n for n, s in shapes.items() if len(s) == 1 or n.startswith(("embed", "lm_head")))
    man = _manifest(tmp_path / "kahan")
    assert man["master_weights"] == "kahan" and man["optimizer"]["scalars"] == {"t": K}
    assert all(man["tensors"][f"comp.{n}"]["dtype"] == "bfloat16" for n in shapes)
    assert not any(k.startswith("master.") for k in man["tensors"])
    assert any(k.startswith("rng.sr.rank") for k in _manifest(tmp_path / "sr")["tensors"])


def _param_shapes():
    from fived.checkpoint.convert import param_shapes

    return param_shapes(DENSE)


@pytest.mark.slow
def test_tp2_and_other_modes_resume_bit_exact(tmp_path):
    """tp2 (+SP) for adamw, muon, rownorm; --master-weights none; the master modes under the
    piece-aware optimizers; --zero-align rows; kahan under ZeRO-3."""
    tp2 = ParallelConfig(tp=2, sequence_parallel=True)
    cases = {
        "adamw-tp2": (tp2, "adamw"),
        "muon-tp2": (tp2, "muon"),
        "rownorm-tp2": (tp2, "rownorm"),
        "adafactor-kahan-tp2": (replace(tp2, master_weights="kahan", **BF16), "adafactor"),
        "none": (replace(Z2, master_weights="none", **BF16), "adamw"),
        "muon-sr": (replace(Z2, master_weights="sr", **BF16), "muon"),
        "rownorm-rows": (replace(Z2, zero=1, zero_align="rows"), "rownorm"),
        "kahan-z3": (replace(Z2, zero=3, master_weights="kahan", **BF16), "adafactor"),
    }
    _check_bit_exact(tmp_path, cases)


@pytest.mark.slow
def test_reshard_optimizer_states_and_master_modes(tmp_path):
    """Adafactor dp2·ZeRO-1 -> tp2 and -> dp2·ZeRO-3; Muon dp2·ZeRO-1 -> tp2; rownorm
    ZeRO-2 -> --zero-align rows; kahan ZeRO-2 -> dp2·ZeRO-0 (c resharded like a master: each
    rank now reads both shards; the bf16 arithmetic of dp2 is unchanged, so 1e-5 holds —
    under tp2 the bf16 compute's own rounding differs by ~2e-5)."""
    z1 = ParallelConfig(dp=2, zero=1)
    tp2 = ParallelConfig(tp=2, sequence_parallel=True)
    cases = {
        "adafactor": (z1, "adafactor"),
        "muon": (z1, "muon"),
        "rownorm": (Z2, "rownorm"),
        "kahan": (replace(Z2, master_weights="kahan", **BF16), "adamw"),
    }
    _check_bit_exact(tmp_path, cases, [
        ("adafactor", tp2), ("adafactor", ParallelConfig(dp=2, zero=3)), ("muon", tp2),
        ("rownorm", replace(Z2, zero_align="rows")),
        ("kahan", replace(Z2, zero=0, master_weights="kahan", **BF16))])


@pytest.mark.slow
def test_moe_expert_states_resume_and_reshard(tmp_path):
    """MoE (expert parameters: local names differ from global ones under ep): adafactor on
    ep2·ZeRO-2 and muon on ep2·ZeRO-1 bit for bit; resumed under tp2·ZeRO-1 and dp2·ZeRO-2
    (ep 1) within 1e-5."""
    cases = {"adafactor": (ParallelConfig(ep=2, zero=2), "adafactor"),
             "muon": (ParallelConfig(ep=2, zero=1), "muon")}
    _check_bit_exact(tmp_path, cases, [("adafactor", ParallelConfig(tp=2, ep=1, zero=1)),
                                       ("muon", ParallelConfig(dp=2, ep=1, zero=2))],
                     model=PRESETS["tiny-moe"])


def test_master_mode_conversions_on_one_rank(tmp_path):
    """An fp32-master checkpoint into --master-weights kahan: θ = bf16(master), c = the rest
    (θ + c = master to 1e-5); that kahan state saved again and read into an fp32-master run:
    master = θ + c exactly. One rank."""
    par = ParallelConfig(precision="bf16")
    d, d2 = str(tmp_path / "fp32m"), str(tmp_path / "kahan")
    master, kahan, back = run_ranks(_masters, 1, [
        (DENSE, par, replace(TRAIN, stop_after=2, save_dir=d)),
        (DENSE, replace(par, master_weights="kahan"), replace(TRAIN, resume=d, save_dir=d2)),
        (DENSE, par, replace(TRAIN, resume=d2))], timeout=600)[0]
    for n in master:
        want = torch.tensor(master[n]["master"])
        theta, comp = torch.tensor(kahan[n]["theta"]), torch.tensor(kahan[n]["comp"])
        assert torch.equal(theta, want.bfloat16().float()), n
        assert comp.abs().max() > 0, n
        assert rel_diff((theta + comp).tolist(), want.tolist()) < 1e-5, n
        assert torch.equal(torch.tensor(back[n]["master"]), theta + comp), n


def _masters(rank: int, world: int, runs: list) -> list[dict]:
    """Per run: load ``resume``, step up to ``stop_after``, save to ``save_dir``; then each
    parameter's master (or θ), θ and Kahan c, flat lists."""
    from fived.checkpoint import load, resolve
    from fived.train.trainer import Trainer

    out = []
    for m, p, t in runs:
        tr = Trainer(m, p, t, rank, world)
        done = load(tr, resolve(t.resume)) if t.resume else 0
        for s in range(done, t.stop_after):
            tr.step(s)
        if t.save_dir:
            from fived.checkpoint import Saver

            Saver(tr, t.save_dir, 0).save(max(done, t.stop_after))
        eng, res = tr.engine, {}
        for b in eng.buckets:
            for j, name in enumerate(b.names):
                lo, n = b.offsets[j], b.params[j].numel()
                res[name] = {
                    "master": (b.master if b.master is not None else b.param_shard)
                    [lo:lo + n].float().tolist(),
                    "theta": b.param_shard[lo:lo + n].float().tolist(),
                    "comp": (b.comp[lo:lo + n].float().tolist() if b.comp is not None
                             else [0.0] * n)}
        tr.close()
        out.append(res)
    return out


def test_missing_optimizer_state_is_refused(tmp_path):
    """A checkpoint of the same optimizer without a state this run needs (here Muon's v, as a
    checkpoint from before it was saved would be) is a ConfigError naming the tensors, not a
    silently fresh state. One rank, one spawn."""
    t = replace(TRAIN, optimizer="muon", save_dir=str(tmp_path / "muon"))
    msg = run_ranks(_resume_error, 1, (DENSE, ParallelConfig(), t), timeout=600)[0]
    assert "lacks" in msg and "optim.v.embed_tokens.weight" in msg, msg


def _resume_error(rank: int, world: int, run: tuple) -> str:
    """Train a step, save, drop every ``optim.v.*`` from the manifest, load: the error."""
    from pathlib import Path

    from fived.checkpoint import Saver, load, resolve
    from fived.config import ConfigError
    from fived.train.trainer import Trainer

    m, p, t = run
    tr = Trainer(m, p, t, rank, world)
    tr.step(0)
    Saver(tr, t.save_dir, 0).save(1)
    tr.close()
    step = resolve(t.save_dir)
    man = json.loads((Path(step) / "manifest.json").read_text())
    man["tensors"] = {k: v for k, v in man["tensors"].items() if not k.startswith("optim.v.")}
    (Path(step) / "manifest.json").write_text(json.dumps(man))
    tr = Trainer(m, p, replace(t, save_dir=None), rank, world)
    try:
        load(tr, step)
    except ConfigError as e:
        return str(e)
    finally:
        tr.close()
    return ""
