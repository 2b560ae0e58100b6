"""``--log-every N``: the live line and the metrics file at that cadence, the first and last step
always (the file's first record names the run for ``fived ledger --check``)."""

import json

from fived.config import ParallelConfig, preset
from fived.testing import small_train


def test_log_every_sets_the_cadence_of_the_file_and_the_live_line(tmp_path, monkeypatch):
    from fived.train import metrics
    from fived.train.trainer import train_rank

    shown = []
    monkeypatch.setattr(metrics.LiveDisplay, "update", lambda self, rec: shown.append(rec["step"]))
    path = tmp_path / "m.jsonl"
    out = train_rank(0, 1, preset("tiny"), ParallelConfig(),
                     small_train(steps=6, log_every=3, metrics_out=str(path)), show=True)
    written = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert written == shown == [0, 2, 5]
    assert "run" in json.loads(path.read_text().splitlines()[0])
    assert len(out["losses"]) == 6  # every step trained and kept in the summary
