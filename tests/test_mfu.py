"""MFU = model FLOPs per token × tokens/s over the machine's peak, each factor checked apart from
the code that computes it: the FLOPs per token counted by hand from the built model's weight
shapes (6 × the weights one token multiplies + 12·L·s·heads·head_dim of attention), the tokens
from the run's configuration, the seconds the run recorded, the peak the sum of what every rank
measured at the same moment (here a known per-rank value, so the sum is exact). A measured MFU
above 100 % (the machine got quieter after the measurement) is shown as "n/a (loaded)"."""

import json

import pytest
import torch
from rich.console import Console

from fived.config import ModelConfig, preset
from fived.ledger.compute import model_flops_per_token
from fived.model.llama import Transformer
from fived.train.metrics import MEASURE_PEAK, measure_world_peak, mfu_of, mfu_text, summary_table


def test_mfu_text_refuses_more_than_the_machine():
    assert mfu_text(0.5) == "50.0%" and mfu_text(1.0) == "100.0%"
    assert mfu_text(1.01) == "n/a (loaded)"
    assert mfu_of(6.0, 10.0, 120.0) == 0.5 and mfu_of(6.0, 10.0, 0.0) == 0.0
    assert MEASURE_PEAK < 0


def test_summary_says_why_mfu_is_na():
    mem = {"params": 1, "grads": 1, "master": 0, "optimizer": 2}
    recs = [{"loss": 5.0 - i, "tokens_per_s": 100.0, "mfu": m, "seconds": 0.1,
             "memory_per_rank": [mem], "traffic_per_rank": [{"bytes": {}}]}
            for i, m in enumerate([0.9, 0.25, 0.2, 0.3])]
    c = Console(record=True, width=120)
    c.print(summary_table(recs))
    assert "25.00%" in c.export_text()  # the median after the warm-up step, as a percentage
    for r in recs:
        r["mfu"] = 1.7
    c = Console(record=True, width=120)
    c.print(summary_table(recs))
    text = c.export_text()
    assert "n/a (loaded)" in text and "measured 170% > 100%" in text


def hand_flops_per_token(cfg: ModelConfig) -> float:
    """6 × (the weights one token multiplies: every 2-D weight of the built model but the
    embedding lookup, a MoE layer's experts as top_k of them) + attention's QKᵀ and PV, not
    causal-halved: 2·2·s·heads·head_dim forward per layer, ×3 for forward + backward."""
    model = Transformer(cfg)  # small: built in milliseconds (a meta device costs seconds here)
    mm = 0.0
    for name, p in model.named_parameters():
        if p.dim() != 2 or name.startswith("embed_tokens"):
            continue
        mm += p.numel() * (cfg.top_k / cfg.experts if ".experts." in name else 1)
    return 6 * mm + 3 * 4 * cfg.layers * cfg.seq_len * cfg.heads * cfg.head_dim


def test_model_flops_per_token_is_the_hand_count():
    dense = ModelConfig(vocab=96, hidden=32, layers=3, heads=4, kv_heads=2, ffn=80, seq_len=24)
    # tiny: 6·(4·(64·64·2 + 32·64·2 + 3·176·64) + 256·64) + 12·4·64·4·16
    assert hand_flops_per_token(preset("tiny")) == 6 * (4 * 46080 + 16384) + 12 * 4 * 64 * 64
    for cfg in (dense, preset("tiny"), preset("tiny-moe")):
        assert model_flops_per_token(cfg) == pytest.approx(hand_flops_per_token(cfg), rel=1e-12)


def _peak_rank(rank, world):
    return measure_world_peak(world, torch.device("cpu"), seconds=0.1)


def test_world_peak_is_every_ranks_sum_measured_at_once():
    from fived.ranks.launch import run_local

    peaks = run_local(_peak_rank, 2, timeout=120)
    assert peaks[0] == peaks[1] > 0  # one sum, the same on every rank
    assert measure_world_peak(1, "cpu", seconds=0.05) > 0  # one rank: its own, no group


RANK_PEAK = (1.0e9, 2.0e9)  # what each rank's matmul "measures" in the test below


def _train_known_peaks(rank, world, model, par, train, show, peak):
    """``fived train``'s rank function, with each rank's matmul peak a known number."""
    from fived.train import metrics, trainer

    metrics.measure_matmul_peak = lambda *a, **k: RANK_PEAK[rank]
    return trainer.train_rank(rank, world, model, par, train, False, peak)


def test_train_mfu_is_model_flops_over_every_ranks_peak(tmp_path, monkeypatch):
    """`fived train --dp 2` asks every rank to measure (MEASURE_PEAK, not a number the parent
    measured with other threads), the denominator is the ranks' sum, and each step's recorded
    MFU is the hand count × the configured tokens / the recorded seconds / that sum."""
    import fived.ranks.launch as launch
    from fived.cli.main import main

    real = launch.run_local
    seen = []

    def run_local(fn, world, args, **kw):
        seen.append((fn.__name__, world, args[-1]))
        return real(_train_known_peaks, world, args, **kw)

    monkeypatch.setattr(launch, "run_local", run_local)
    out = tmp_path / "m.jsonl"
    assert main(["train", "--dp", "2", "--steps", "2", "--global-batch", "4",
                 "--metrics-out", str(out)]) == 0
    assert seen == [("train_rank", 2, MEASURE_PEAK)]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    run = recs[0]["run"]
    cfg = ModelConfig(**run["model"])
    assert len(recs) == 2 and run["global_batch"] == 4
    for rec in recs:
        assert rec["tokens"] == 4 * cfg.seq_len  # the global batch, every rank's tokens
        tps = rec["tokens"] / rec["seconds"]
        assert rec["tokens_per_s"] == pytest.approx(tps, rel=1e-12)
        want = hand_flops_per_token(cfg) * tps / sum(RANK_PEAK)
        assert rec["mfu"] == pytest.approx(want, rel=1e-9), (rec["mfu"], want)
