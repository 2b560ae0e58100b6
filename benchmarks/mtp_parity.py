"""Parity gaps of multi-token prediction and of tied embeddings under pp against one rank
(fp32, the models and training of ``tests/test_mtp.py``, 3 steps): the largest relative gap
of the trunk's losses, of each module's losses (every step, every rank) and of the gathered
first-step gradients; and the one-rank objective and gradients against the hand-written
computation. World 2, 4 and 16 (each world one spawn; ~3½ minutes on 2 loaded cores).

    PYTHONPATH=. python benchmarks/mtp_parity.py
"""

from __future__ import annotations

import os
import sys

from fived.config import ParallelConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from parity_helpers import grad_rel_diff, one_rank, rel_diff, train_runs  # noqa: E402
from test_mtp import MOE, MTP, TIED, TRAIN, hand_objective  # noqa: E402


def gaps(out, ref):
    dl = max(rel_diff(s["losses"], ref["losses"]) for s in out["ranks"])
    want = [h.get("mtp_losses") or [0.0] for h in ref["ranks"][0]["history"]]
    dm = max(rel_diff(g.get("mtp_losses") or [0.0], w) if any(w) else 0.0
             for s in out["ranks"] for g, w in zip(s["history"], want))
    return dl, dm, grad_rel_diff(out["grads"], ref["grads"])


def main():
    import torch

    from fived.model import build_model
    model = build_model(MTP, 3)
    t = torch.randint(0, MTP.vocab, (3, MTP.seq_len + 1),
                      generator=torch.Generator().manual_seed(0))
    a = model(t[:, :-1], torch.arange(MTP.seq_len), t[:, 1:])
    a.backward()
    g1 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    b, _ = hand_objective(model, t[:, :-1], t[:, 1:])
    b.backward()
    gg = max(float((g1[n] - p.grad).norm() / p.grad.norm()) for n, p in model.named_parameters())
    gap = abs(float(a.detach() - b.detach())) / float(b.detach())
    print(f"{'one rank vs hand-written':32s} loss {gap:.1e}  grad {gg:.1e}")
    ref = {m.name: one_rank(m, TRAIN) for m in (MTP, TIED, MOE)}
    runs = {2: [(MTP, ParallelConfig(tp=2, sequence_parallel=True)), (MTP, ParallelConfig(cp=2)),
                (MTP, ParallelConfig(cp=2, cp_mode="ulysses")),
                (MTP, ParallelConfig(pp=2, micro_batches=2)),
                (TIED, ParallelConfig(pp=2, micro_batches=2)), (MTP, ParallelConfig(dp=2, zero=3))],
            4: [(MOE, ParallelConfig(ep=2, tp=2, sequence_parallel=True))],
            16: [(MTP, ParallelConfig(tp=2, cp=2, pp=2, dp=2, zero=1, micro_batches=2))]}
    for lays in runs.values():
        for (m, p), out in zip(lays, train_runs([(m, p, TRAIN) for m, p in lays])):
            dl, dm, g = gaps(out, ref[m.name])
            desc = f"{m.name} {p.describe()}" + (f" {p.cp_mode}" if p.cp > 1 else "")
            print(f"{desc:32s} loss {dl:.1e}  mtp {dm:.1e}  grad {g:.1e}")


if __name__ == "__main__":
    main()
