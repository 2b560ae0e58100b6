"""--data with checkpoints: the data position travels in the checkpoint, so k steps, save,
resume, N-k steps equals N steps straight, bit for bit (the loader is a pure function of
(seed, step, data) and the trainer's data_state carries the step and the data's identity)."""

from dataclasses import replace

from fived.config import ParallelConfig, preset
from fived.data.meta import model_for_data
from fived.data.prepare import Options, prepare
from fived.testing import run_ranks, small_train


def _losses(rank, world, runs):
    from fived.train.trainer import train_rank

    return [train_rank(rank, world, m, p, t, show=False)["losses"] for m, p, t in runs]


def test_resume_on_prepared_data_continues_the_same_batches(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(8):
        (tmp_path / "in" / f"{i}.txt").write_text("".join(f"x{i} = {k} * {i}\n" for k in range(40)))
    prepare(Options((str(tmp_path / "in"),), str(tmp_path / "d"), val_fraction=0.25, workers=1),
            lambda s: None)
    model = model_for_data(preset("tiny"), str(tmp_path / "d"))
    train = small_train(steps=4, data=str(tmp_path / "d"))
    par, ck = ParallelConfig(dp=2, zero=1), str(tmp_path / "ck")
    full, first, rest = run_ranks(_losses, 2, [
        (model, par, train), (model, par, replace(train, stop_after=2, save_dir=ck)),
        (model, par, replace(train, resume=ck))], timeout=900)[0]
    assert len(first) == 2 and len(rest) == 2
    assert first + rest == full
