"""MLA's parity gaps against one rank (fp32; the largest relative loss difference on any rank
over 3 steps, the relative norm difference of the gathered first-step gradients) at every
layout tests/test_mla.py trains, printed one line each.

    .venv/bin/python benchmarks/mla_parity_gaps.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from dataclasses import replace

from parity_helpers import one_rank
from test_mla import DS, PLAIN_Q, TRAIN, WORLD2

from fived.config import ParallelConfig
from fived.testing import grad_rel_diff, rel_diff, train_runs


def main() -> None:
    refs = {m.name: one_rank(m, TRAIN) for m in (DS, PLAIN_Q)}

    def show(runs, outs, ref_of):
        for (m, par, t), out in zip(runs, outs):
            ref = ref_of(m, t)
            loss = max(rel_diff(s["losses"], ref["losses"]) for s in out["ranks"])
            g = grad_rel_diff(out["grads"], ref["grads"])
            what = par.describe() + (f" {par.cp_mode}" if par.cp > 1 else "") + (
                f" recompute {par.recompute}" if par.recompute != "none" else "")
            print(f"{m.name:17} {what:36} losses {loss:.1e}  grads {g:.1e}")
    show(WORLD2, train_runs(WORLD2), lambda m, t: refs[m.name])
    W4 = [(DS, ParallelConfig(ep=2, tp=2, sequence_parallel=True), TRAIN),
          (DS, ParallelConfig(tp=2, cp=2, sequence_parallel=True), TRAIN),
          (DS, ParallelConfig(tp=2, cp=2, zero=1, cp_mode="ulysses", sequence_parallel=True), TRAIN),
          (DS, ParallelConfig(tp=4), TRAIN)]
    show(W4, train_runs(W4), lambda m, t: refs[m.name])
    t8 = replace(TRAIN, global_batch=8)
    W16 = [(DS, ParallelConfig(pp=2, ep=2, cp=2, tp=2, micro_batches=2, sequence_parallel=True, zero=1), t8)]
    show(W16, train_runs(W16, timeout=1800), lambda m, t: one_rank(m, t))

if __name__ == '__main__':
    main()
