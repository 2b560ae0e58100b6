"""The trainer's data, opened before the layout and placed after it.

``open_loaders`` opens ``--data`` from the train config alone (no grid); ``Loader.place``
then gives a loader its batch-group rows. A loader opened layout-free and placed on member r
of R serves exactly the rows of one built with ``replica=r, replicas=R`` (a mixture's sources
placed with it); a global batch that R does not divide is refused; ``open_loaders`` refuses a
tokenizer larger than the model's vocabulary. Mutation seen to fail: ``place`` leaving the
rows per member at the whole batch (the first assertion)."""

from dataclasses import replace

import pytest
import torch
from doc_helpers import prepared

from fived.config import ConfigError, preset
from fived.data.loader import MixtureLoader, open_loader
from fived.testing import small_train
from fived.train.data import open_loaders


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("place")
    return prepared(base / "a", seed=1, long=20), prepared(base / "b", seed=2, short=20)


def test_a_placed_loader_serves_the_rows_of_one_built_for_them(dirs):
    kw = dict(seq_len=32, batch=8, seed=5, documents=True)
    for spec in (dirs[0], f"code={dirs[0]}:0.3,web={dirs[1]}:0.7"):
        for r, n in ((0, 1), (1, 2), (3, 4)):
            built = open_loader(spec, "train", replica=r, replicas=n, **kw)
            placed = open_loader(spec, "train", **kw).place(r, n)
            assert (placed.replica, placed.replicas, placed.per) == (r, n, 8 // n)
            for step in (0, 5):
                assert all(torch.equal(a, b) for a, b in
                           zip(built.batch(step), placed.batch(step)))
            if isinstance(placed, MixtureLoader):  # its sources on the same rows
                assert {(p.replica, p.replicas) for p in placed.parts} == {(r, n)}
    with pytest.raises(ValueError, match="not divisible by 3"):
        open_loader(dirs[0], "train", **kw).place(0, 3)


def test_open_loaders_needs_no_layout_and_checks_the_vocabulary(dirs):
    model = replace(preset("tiny"), vocab=320)  # the byte tokenizer's 257 symbols, padded
    train = replace(small_train(steps=1), data=dirs[0], eval_every=1)
    loader, evals, by_source = open_loaders(train, model)
    assert (loader.split, evals.split, by_source) == ("train", "val", {})
    assert (loader.replica, loader.replicas, loader.device) == (0, 1, None)
    mix = replace(train, data=f"code={dirs[0]}:1,web={dirs[1]}:1")
    loader, evals, by_source = open_loaders(mix, model, eval_split="val")
    assert loader is None and sorted(by_source) == ["code", "web"]
    assert open_loaders(replace(train, data=""), model) == (None, None, {})
    with pytest.raises(ConfigError, match="the tokenizer has 257 symbols"):
        open_loaders(train, replace(model, vocab=64))
