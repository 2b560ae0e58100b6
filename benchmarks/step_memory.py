"""Where one training step's memory goes on one rank: the resident peak per phase, the live
tensors at the forward + backward peak, and the ledger's activations and buffers.

    PYTHONPATH=. python benchmarks/step_memory.py [--config FILE.toml] [--global-batch N]

One rank, fp32, the model of ``--config`` (default: ``tiny-moe``). Steps 0, 1 and 2 are
measured (step 0 on a cold allocator: the run's high-water mark). For each phase of a step
(forward + backward, the gradient reduction, the clip, the optimizer step) the process's peak
RSS is reset (``/proc/self/clear_refs``) before the phase and read after it: the rise over the
RSS at the phase's start. Then forward + backward runs once more under ``torch.profiler``
(``profile_memory``), and the rise of the live tensors at their peak is compared with the
ledger's activations + transient buffers for the same layout (``fived.ledger.memory.
rank_memory``, the runtime's saves). Resident memory above the live tensors is the allocator
keeping freed pages, not tensors.
"""

from __future__ import annotations

import argparse
from dataclasses import replace


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024  # MiB
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _phase(name: str, fn, out: dict):
    def run(*a, **k):
        base = _status("VmRSS")
        _reset_peak()
        r = fn(*a, **k)
        out.setdefault(name, []).append(_status("VmHWM") - base)
        return r
    return run


def tensor_peak_mib(trainer, step: int) -> float:
    """The live tensors' rise (MiB) at their peak during one forward + backward (profiler)."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    x, y, pos = trainer.local_data(step)
    trainer.engine.zero_grad()
    tokens = trainer.tcfg.global_batch * trainer.cfg.seq_len
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        trainer.forward_backward(x, y, pos, 1.0 / tokens)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(
        torch.device("cpu"))
    total = np.asarray(sizes).sum(1)
    return float(total.max() - total[0]) / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="a fived TOML (its [model]; default: tiny-moe)")
    ap.add_argument("--global-batch", type=int, default=2)
    a = ap.parse_args()
    from fived.config import ParallelConfig, TrainConfig, load_toml, preset
    from fived.ledger.memory import rank_memory
    from fived.ledger.traffic import micro_batch_size
    from fived.train.trainer import Trainer

    if a.config:
        m, par, t = load_toml(a.config)
    else:
        m, par, t = preset("tiny-moe"), ParallelConfig(), TrainConfig()
    par = replace(ParallelConfig(), precision="fp32", micro_batches=par.micro_batches)
    t = replace(t, global_batch=a.global_batch, steps=3)
    print(f"step memory: {m.name}, one rank, fp32, global batch {a.global_batch} × "
          f"{m.seq_len} tokens", flush=True)
    tr = Trainer(m, par, t, 0, 1)
    print(f"built: RSS {_status('VmRSS'):.0f} MiB", flush=True)
    out: dict[str, list[float]] = {}
    eng = tr.engine
    tr.forward_backward = _phase("forward + backward", tr.forward_backward, out)
    eng.finish = _phase("gradient reduction", eng.finish, out)
    eng.clip = _phase("clip", eng.clip, out)
    eng.step = _phase("optimizer step", eng.step, out)
    for s in range(3):
        tr.step(s)
    del tr.forward_backward  # the profiler pass runs the plain method
    tensors = tensor_peak_mib(tr, 3)
    led = rank_memory(m, par, micro_batch_size(par, t.global_batch))
    ledger = (led.activations_total + led.buffers_total) / 2**20
    print(f"{'phase':<22} {'RSS rise, step 0':>17} {'step 1':>8} {'step 2':>8}   (MiB)")
    for name, v in out.items():
        print(f"{name:<22} {v[0]:>17.0f} {v[1]:>8.0f} {v[2]:>8.0f}")
    print(f"forward + backward, live tensors at their peak: {tensors:.0f} MiB; the ledger's "
          f"activations + buffers: {ledger:.0f} MiB ({tensors / ledger:.2f}×)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
