"""``--tensorboard DIR``: the step records as TensorBoard scalars (``torch.utils.tensorboard``).

Rank 0 writes, per step ``s``: ``train/loss``, ``train/lr``, ``train/grad_norm``,
``speed/tokens_per_s``, ``speed/mfu``, ``speed/step_seconds``; ``memory/<part>`` (params,
grads, master, optimizer, buffers, padding) for the rank holding the most model-state bytes,
and ``memory_rank<r>/<part>`` for every rank; ``traffic/<group>`` the bytes the busiest rank
sent in that group (tp, cp, ep, dp, pp, dense, expert, ...) that step; with evaluation
``val/loss`` and ``val/perplexity``. The JSONL of ``--metrics-out`` is unchanged.
"""

from __future__ import annotations

from typing import Any

STATE = ("params", "grads", "master", "optimizer")


class TensorBoard:
    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=logdir)

    def log(self, rec: dict[str, Any]) -> None:
        s, w = rec["step"], self.w
        for tag, key in (("train/loss", "loss"), ("train/lr", "lr"),
                         ("train/grad_norm", "grad_norm"), ("speed/tokens_per_s", "tokens_per_s"),
                         ("speed/mfu", "mfu"), ("speed/step_seconds", "seconds"),
                         ("val/loss", "val_loss"), ("val/perplexity", "val_ppl")):
            if rec.get(key) is not None:
                w.add_scalar(tag, float(rec[key]), s)
        for name, v in (rec.get("val_loss_by_source") or {}).items():  # a mixture's sources
            w.add_scalar(f"val/loss_{name}", float(v), s)
        for name, v in (rec.get("loss_by_source") or {}).items():
            if v is not None:
                w.add_scalar(f"train/loss_{name}", float(v), s)
        for k, v in enumerate(rec.get("mtp_losses") or [], start=1):  # each MTP module's
            w.add_scalar(f"train/mtp_loss_{k}", float(v), s)
        mems = rec.get("memory_per_rank") or []
        if mems:
            worst = max(mems, key=lambda m: sum(m.get(k, 0) for k in STATE))
            for part, b in worst.items():
                w.add_scalar(f"memory/{part}", b, s)
            for r, m in enumerate(mems):
                for part, b in m.items():
                    w.add_scalar(f"memory_rank{r}/{part}", b, s)
        per_dim: dict[str, float] = {}
        for t in rec.get("traffic_per_rank") or []:
            for dim, b in t["bytes"].items():
                per_dim[dim] = max(per_dim.get(dim, 0.0), b)
        for dim, b in per_dim.items():
            if dim != "metrics":
                w.add_scalar(f"traffic/{dim}", b, s)
        w.flush()

    def close(self) -> None:
        self.w.close()
