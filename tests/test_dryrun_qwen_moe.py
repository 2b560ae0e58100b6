"""Issue 29's full-scale dry run: ``qwen3-235b-a22b`` (128 experts of 1536, top-8, q/k norms,
GQA 64/4) at ep8 · tp4+sp · pp8 · dp2, ZeRO-1, bf16, seq 4096 (512 ranks) on fake meta
tensors; states and traffic per rank equal the ledger's to the byte, activations within 0.5 %.

The fast sibling is ``tests/test_dryrun.py``'s check of the recorded run
(``docs/dryrun/qwen3_235b.jsonl``, all five distinct ranks) and the tiny dry run below at the
same kind of layout; the slow test runs two ranks of the real size again."""

from __future__ import annotations

import json

import pytest

from fived.cli import main
from fived.config import ParallelConfig, TrainConfig, preset

torch = pytest.importorskip("torch")

LAYOUT = ["--ep", "8", "--tp", "4", "--pp", "8", "--dp", "2", "--zero", "1",
          "--sequence-parallel", "--micro-batches", "8", "--global-batch", "128",
          "--precision", "bf16"]


def test_tiny_qwen_moe_at_the_235b_kind_of_layout():
    """qwen3-moe-tiny (q/k norms, renormalised top-k, many experts per rank) at
    ep2 · tp2+sp · pp2, ZeRO-1, bf16: every distinct rank exact."""
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    m = preset("qwen3-moe-tiny")
    par = ParallelConfig(ep=2, tp=2, pp=2, sequence_parallel=True, zero=1, micro_batches=2,
                         precision="bf16")
    out = dry_run(m, par, TrainConfig(global_batch=4), distinct_ranks(par), show=False)
    assert verify.compare_record(m, par, 4, out) == []


@pytest.mark.slow
def test_qwen3_235b_dry_run_is_exact(tmp_path):
    """Ranks 0 (first stage) and 448 (last stage, the head and the loss): about 2 minutes."""
    path = tmp_path / "q235.jsonl"
    rc = main(["train", "--dry-run", "--model", "qwen3-235b-a22b", *LAYOUT, "--ranks", "0,448",
               "--metrics-out", str(path)])
    assert rc == 0
    assert main(["ledger", "--check", str(path)]) == 0
    rec = json.loads(path.read_text().splitlines()[-1])
    assert rec["ranks"] == [0, 448]
    assert sum(rec["memory_per_rank"][0].values()) > 40 * 2**30  # 42.86 GiB of states
    assert rec["traffic_per_rank"][0]["bytes"]["ep"] > 0
