"""The rank functions of the Hugging Face tests, in a module that does not import transformers:
a rank of the suite's pool imports the module of the function it runs, and transformers costs
seconds per rank."""

from __future__ import annotations

from dataclasses import replace

import torch

from fived.checkpoint import hf
from fived.testing import small_train

SEQ = 16


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _layout_logits(rank: int, world: int, jobs: list) -> list:
    """Each (hf_dir, layout): --init-from into the layout, a forward of ``tokens()`` through
    its pipeline stages (hidden states sent stage to stage), vocab pieces gathered over tp;
    the last stage's ranks return the whole logits."""
    import torch.distributed as dist

    from fived.train.trainer import Trainer

    out = []
    for hf_dir, par in jobs:
        cfg = hf.model_config(hf.read_config(hf_dir, "--init-from"), seq_len=SEQ)
        t = Trainer(cfg, par, replace(small_train(), init_from=str(hf_dir)), rank, world)
        g, stage, pos = t.grid, t.stage, torch.arange(SEQ)
        with torch.no_grad():
            if par.pp > 1 and not stage.first:
                h = torch.empty(2, SEQ, cfg.hidden)
                dist.recv(h, src=g["pp"].ranks[g["pp"].rank - 1])
                x = h
            else:
                x = tokens()
            y = stage(x, pos)
            if par.pp > 1 and not stage.last:
                dist.send(y.contiguous(), dst=g["pp"].ranks[g["pp"].rank + 1])
                out.append(None)
                continue
            if par.tp > 1:
                parts = [torch.empty_like(y) for _ in range(par.tp)]
                dist.all_gather(parts, y.contiguous(), group=g["tp"].pg)
                y = torch.cat(parts, dim=-1)
            out.append(y.numpy())
    return out


def _train_and_save(rank, world, m, par, t):
    from fived.train.trainer import train_rank

    return train_rank(rank, world, m, par, t, show=False)["losses"]


def _cp_logits(rank: int, world: int, hf_dir, layouts: list) -> list:
    """--init-from into each context-parallel layout: this rank's zigzag shard of ``tokens()``
    through the model, the cp shards' logits all-gathered and put back in sequence order."""
    import torch.distributed as dist

    from fived.parallel.context import shard_positions
    from fived.train.trainer import Trainer

    cfg = hf.model_config(hf.read_config(hf_dir, "--init-from"), seq_len=SEQ)
    out = []
    for par in layouts:
        t = Trainer(cfg, par, replace(small_train(), init_from=str(hf_dir)), rank, world)
        cp = t.grid["cp"]
        pos = shard_positions(SEQ, cp.size, cp.rank)
        with torch.no_grad():
            y = t.stage(tokens()[:, pos].contiguous(), pos)
        parts = [torch.empty_like(y) for _ in range(cp.size)]
        dist.all_gather(parts, y.contiguous(), group=cp.pg)
        where = torch.cat([shard_positions(SEQ, cp.size, r) for r in range(cp.size)])
        full = torch.empty(y.shape[0], SEQ, y.shape[-1])
        full[:, where] = torch.cat(parts, dim=1)
        out.append(full.numpy())
    return out
