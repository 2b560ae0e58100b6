"""Saved-tensor bytes of one forward of `small` at tp2 + SP, fp32, per rank (real ranks, gloo),
beside the ledger's prediction; micro-batch 8 sequences (global batch 16 over dp 2)."""
import sys

import torch

from fived.config import ParallelConfig, preset
from fived.testing import run_ranks

B = 8


def rank(r, world):
    from fived.comm.ops import Traffic
    from fived.model import build_model
    from fived.parallel.parallelize import parallelize_parts
    from fived.ranks.grid import Grid
    from fived.train.activations import SavedTensors
    m = preset("small")
    par = ParallelConfig(tp=2, sequence_parallel=True)
    grid = Grid.from_config(par, r).connect(Traffic())
    (model,), _ = parallelize_parts(build_model(m, 1), grid, par)
    x = torch.randint(0, m.vocab, (B, m.seq_len), generator=torch.Generator().manual_seed(0))
    with SavedTensors(list(model.parameters())) as s:
        loss = model(x, torch.arange(m.seq_len), x)
    loss.backward()
    return s.bytes


if __name__ == "__main__":
    from fived.ledger import memory
    m = preset("small")
    par = ParallelConfig(tp=2, sequence_parallel=True)
    got = run_ranks(rank, 2)
    pred = memory.activations(m, par, B)
    layer = memory.layer_activations(m, par, B)
    print(sys.argv[1:], "measured per rank", got, "ledger", sum(pred.values()),
          "ledger per layer", sum(layer.values()), {k: v for k, v in layer.items()})
