"""A checkpoint written before a change still loads after it, and resumes to the same losses bit
for bit (the checkpoint format and the training step must not drift).

``tests/fixtures/checkpoint-dp2-zero1`` was written by commit a409d03 (the trainer as parts,
before its loop's fixed costs were folded): a model of width 16, 2 blocks, sequences of 16, on
dp 2 with ZeRO-1, 4 steps of global batch 4, stopped and saved after step 2 — as made by::

    m = ModelConfig(name="fixture", hidden=16, layers=2, heads=2, kv_heads=1, ffn=32, seq_len=16)
    par = ParallelConfig(dp=2, zero=1)
    t = small_train(steps=4, global_batch=4)
    train_layout(m, par, replace(t, stop_after=2, save_dir="tests/fixtures/checkpoint-dp2-zero1"))

``LOSSES`` are the losses of steps 2 and 3 that resuming it gave then (equal to the run that never
stopped), as ``float.hex``."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from fived.config import ModelConfig, ParallelConfig
from fived.testing import small_train, train_layout

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint-dp2-zero1"
MODEL = ModelConfig(name="fixture", hidden=16, layers=2, heads=2, kv_heads=1, ffn=32, seq_len=16)
PAR = ParallelConfig(dp=2, zero=1)
TRAIN = small_train(steps=4, global_batch=4)
LOSSES = ["0x1.62b4850000000p+2", "0x1.5ff9eb0000000p+2"]


def test_a_checkpoint_from_before_resumes_to_the_recorded_losses_bit_for_bit(tmp_path):
    """Time: two gloo ranks load the checkpoint and train two steps (about 10 s on a quiet
    machine, up to 30 s under load)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt)  # the fixture stays untouched whatever the loader writes
    runs = train_layout(MODEL, PAR, replace(TRAIN, resume=str(ckpt)))
    for run in runs:
        assert [x.hex() for x in run["losses"]] == LOSSES
