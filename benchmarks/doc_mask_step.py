"""Masked against unmasked training step time: ``small`` at seq 2048, one rank.

For each mean document length L in S, S/4, S/16 a byte-level corpus of documents of exactly L
tokens (their EOS included) is prepared, so every window holds S/L whole documents and
Σ Lᵢ² = S·L per window: masked attention does L/S of the unmasked causal work. Two trainers
are built on that corpus, one with ``--doc-mask`` and one without, and their steps alternate
(masked step s, unmasked step s, masked step s+1, ...) after one warm-up step each, so the
load of the shared machine falls on both alike. Printed per L: the median step seconds of
each, the ratio of the medians (masked / unmasked), the median of the ratios of each masked
step to the unmasked step run right after it, the same for the CPU seconds the process used
in each step (``time.process_time``; with ``--threads 1``, the default, the step's own work,
which the load of a shared machine disturbs far less than the wall clock), and the ratio the
ledger's FLOPs predict
(the step's matmul FLOPs plus causal attention at Σ Lᵢ²/S keys instead of S).

    PYTHONPATH=. python benchmarks/doc_mask_step.py [--rounds 7] [--seq 2048] [--batch 1]
        [--lengths 2048 512 128] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def corpus(path: Path, seq: int, length: int, windows: int) -> None:
    """JSONL of documents of ``length - 1`` ASCII bytes (+ EOS = ``length`` tokens)."""
    import random

    r = random.Random(length)
    with open(path, "w") as f:
        for _ in range(windows * seq // length + 2):
            f.write(json.dumps({"text": "".join(r.choice("abcdefgh ")
                                                for _ in range(length - 1))}) + "\n")


def predicted_ratio(model, seq: int, length: int) -> float:
    """(matmuls + causal attention over Σ Lᵢ²/S keys) / (matmuls + causal attention over S)."""
    from fived.ledger.compute import attention_flops_per_token, doc_context, matmul_params

    dense = 2.0 * matmul_params(model)
    ctx = doc_context(seq, mean=length)
    full = attention_flops_per_token(model, seq, causal=True)
    return (dense + full * ctx / seq) / (dense + full)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed steps per trainer (default 7)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="global batch (default 1)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="document lengths (default S, S/4, S/16)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the CPU seconds are then the step's work)")
    ap.add_argument("--json", default="", help="write the results here too")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)

    from fived.config import ParallelConfig, TrainConfig, preset
    from fived.data.meta import model_for_data
    from fived.data.prepare import Options, prepare
    from fived.train.trainer import Trainer

    S = args.seq
    lengths = args.lengths or [S, S // 4, S // 16]
    steps = args.rounds + 1
    results = []
    with tempfile.TemporaryDirectory(prefix="fived-doc-step-") as tmp:
        for L in lengths:
            src, out = Path(tmp) / f"d{L}.jsonl", Path(tmp) / f"data{L}"
            corpus(src, S, L, windows=args.batch * steps + 4)
            prepare(Options((str(src),), str(out), val_fraction=0.0, workers=1), lambda s: None)
            model = replace(model_for_data(preset(args.model), str(out)), seq_len=S)
            base = replace(TrainConfig(), global_batch=args.batch, steps=steps, data=str(out))
            pair = {"masked": Trainer(model, ParallelConfig(),
                                      replace(base, doc_mask=True), 0, 1),
                    "unmasked": Trainer(model, ParallelConfig(), base, 0, 1)}
            secs: dict[str, list[float]] = {k: [] for k in pair}
            cpu: dict[str, list[float]] = {k: [] for k in pair}
            t0 = time.perf_counter()
            for s in range(steps):
                for name, tr in pair.items():
                    c0 = time.process_time()
                    sec = tr.step(s)["seconds"]
                    if s:  # step 0 is the warm-up
                        secs[name].append(sec)
                        cpu[name].append(time.process_time() - c0)
            for tr in pair.values():
                tr.close()
            med = {k: statistics.median(v) for k, v in secs.items()}
            cmed = {k: statistics.median(v) for k, v in cpu.items()}
            paired = statistics.median(a / b for a, b in zip(secs["masked"], secs["unmasked"]))
            row = {"doc_len": L, "windows_docs": S // L, "median_s": med,
                   "steps_s": secs, "ratio": med["masked"] / med["unmasked"],
                   "paired_ratio": paired, "cpu_median_s": cmed, "cpu_steps_s": cpu,
                   "cpu_ratio": cmed["masked"] / cmed["unmasked"],
                   "predicted": predicted_ratio(model, S, L),
                   "wall_s": time.perf_counter() - t0}
            results.append(row)
            print(f"L {L:5d}: masked {med['masked']:.3f} s, unmasked {med['unmasked']:.3f} s "
                  f"(medians of {args.rounds}), ratio {row['ratio']:.3f} (median of the "
                  f"paired steps' ratios {paired:.3f}); CPU seconds {cmed['masked']:.3f} / "
                  f"{cmed['unmasked']:.3f}, ratio {row['cpu_ratio']:.3f}; ledger FLOPs "
                  f"{row['predicted']:.3f}; masked {[round(x, 2) for x in secs['masked']]}, "
                  f"unmasked {[round(x, 2) for x in secs['unmasked']]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
