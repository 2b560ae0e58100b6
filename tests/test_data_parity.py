"""prepare -> train: dp2·tp2·cp2 on a prepared directory equals one rank, losses, first-step
gradients and the validation loss (the padded vocabulary rows masked on every tp slice)."""

import pytest
from parity_helpers import TOL, check_parity, one_rank, rel_diff, train_runs

from fived.config import ParallelConfig, preset, validate
from fived.data.meta import model_for_data
from fived.data.prepare import Options, prepare
from fived.testing import small_train


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    (d / "in").mkdir()
    for i in range(16):
        (d / "in" / f"{i:02d}.txt").write_text(f"# file {i}\n" + "".join(
            f"def f{k}(x):\n    return x * {i + k}\n" for k in range(12)))
    prepare(Options((str(d / "in"),), str(d / "out"), val_fraction=0.25, workers=1),
            lambda s: None)
    return str(d / "out")


def run_cfg(data_dir, name="tiny", **kw):
    model = model_for_data(preset(name), data_dir)
    assert model.vocab == 384  # 257 byte symbols, padded to a multiple of 128
    train = small_train(steps=3, data=data_dir, eval_every=3, eval_batches=2, **kw)
    return model, train


def check_eval(out, ref):
    assert [s for s, _ in ref["ranks"][0]["val"]] == [0, 2]  # after step 0 and the last
    for s in out["ranks"]:
        d = rel_diff([v for _, v in s["val"]], [v for _, v in ref["ranks"][0]["val"]])
        assert d < TOL, ("validation loss", d, s["val"], ref["ranks"][0]["val"])


def test_dp2_tp2_cp2_on_prepared_data_equals_one_rank(data_dir):
    model, train = run_cfg(data_dir)
    par = ParallelConfig(dp=2, tp=2, cp=2)
    validate(model, par, train, 8)
    ref = one_rank(model, train)
    out = train_runs([(model, par, train)], timeout=600)[0]
    check_parity(out, ref, par.describe())
    check_eval(out, ref)
    assert ref["grads"]["lm_head.weight"][257:].abs().max() == 0  # padded rows: no gradient


@pytest.mark.slow
@pytest.mark.parametrize("name,par", [
    ("tiny", ParallelConfig(pp=2, tp=2, dp=2, zero=1, micro_batches=2)),
    ("tiny", ParallelConfig(tp=4, sequence_parallel=True, dp=2, zero=3)),
    ("tiny-moe", ParallelConfig(ep=2, tp=2, dp=2))], ids=lambda p: getattr(p, "describe", str)())
def test_more_layouts_on_prepared_data(data_dir, name, par):
    model, train = run_cfg(data_dir, name)
    validate(model, par, train, 8)
    ref = one_rank(model, train)
    out = train_runs([(model, par, train)], timeout=900)[0]
    check_parity(out, ref, par.describe())
    check_eval(out, ref)
