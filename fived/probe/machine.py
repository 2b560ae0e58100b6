"""``--gpu this-machine``: a hardware preset measured here, for the roofline clock.

On ``ranks`` local processes at once (the contention a ``fived train`` of that many ranks sees,
each with the runtime's threads per rank), each process times

* a 1×1 matmul: the per-op overhead (dispatch);
* a sweep of fp32 matmuls (M, N, K) around the shapes of the small presets' blocks, and fits
  t = overhead + 2MNK / (P · Π_d d/(d + d0)) per d0 on a grid (P the median of what each
  shape implies; the d0 with the smallest median relative error wins): P is the ceiling
  (peak_fp32 with gemm_eff = 1), d0 the curve's half-saturation dimension;
* an element-wise add over 32 MB (read 2, write 1): the memory bandwidth (mem_eff = 1);
* the runtime model (``fived.model``) at a tiny width with 1 and 3 blocks, forward and
  backward: what the eager runtime costs beyond its kernels, per block and per stage (the
  per-op ``overhead`` is then 0: it is inside these and inside the timed GEMMs);
* with a layout (``par``, from ``fived ledger``): ``fived train``'s own step of a one-block
  width-8 model in that layout, less its block and stage: the trainer's per-step cost
  outside the model (data slicing, gradient reduction and clipping, the optimizer's Python);
* with a model too: the layout's GEMMs, and every other kernel of the runtime's forward and
  backward (``fived.probe.kernels``), each at its shape, as the midpoint of a hot and a cold
  (caches flushed) timing; the dispatch those carry is taken off the per-block cost.

With more ranks × threads than cores the probes run on as many processes as the cores hold
(``time_sharing``), and the preset's ``cores`` (ranks that run at once) lets the planner bound
the step by the ranks' busy time shared over them.

The link (α, β) comes from ``fived bench comm --json`` (``--bench-json``), else a gloo-like
guess (``fived.ledger.hardware.this_machine``). The medians over the ranks are used.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from . import kernels
from .kernels import FLUSH_FLOATS, time_cold, time_hot

SHAPES = [(m, n, k) for m in (128, 512, 2048) for n, k in ((64, 128), (128, 128), (352, 128),
                                                          (128, 352), (128, 2048))]
SHAPES += [(128, 128, 16), (128, 16, 128), (2048, 256, 128)]


def sweep(seconds: float = 0.03, shapes: list | None = None, sync=None) -> dict:
    """Timings on this process: [(M, N, K, s)] and the add's bytes/s. ``sync`` (a barrier
    over the probing ranks) runs before each timing, so every rank times the same kernel at
    the same moment: the contention ``fived train``'s ranks see, not a staggered share of it."""
    import torch

    sync = sync or (lambda: None)

    g = torch.Generator().manual_seed(0)
    one = torch.ones(1, 1)
    sync()
    overhead = time_hot(lambda: one @ one, seconds)
    rows = []
    flush = torch.empty(FLUSH_FLOATS) if shapes else None
    for m, n, k in shapes or SHAPES:
        a = torch.randn(m, k, generator=g)
        b = torch.randn(k, n, generator=g)
        sync()
        t = time_hot(lambda a=a, b=b: a @ b, seconds)
        if shapes:  # a layout's GEMM inside a step: between hot and cold (fived.probe.kernels)
            sync()
            t = (t + time_cold(lambda a=a, b=b: a @ b, flush)) / 2
        rows.append((m, n, k, t))
    x = torch.randn(8 * 2**20, generator=g)
    y = torch.randn(8 * 2**20, generator=g)
    sync()
    bw = 3 * x.numel() * 4 / time_hot(lambda: x.add_(y), seconds * 3)
    return {"rows": rows, "bw": bw, "overhead": overhead}


def _rank_sweep(rank: int, world: int, seconds: float, shapes: list | None,
                layout: tuple | None = None) -> dict:
    import torch.distributed as dist

    out = sweep(seconds, shapes, dist.barrier)
    if shapes is None:
        out["framework"] = framework_overhead(seconds, dist.barrier)
    if layout is not None:
        out["eager"] = kernels.measure(*layout, sync=dist.barrier)
    return out


def framework_overhead(seconds: float = 0.03, sync=None) -> tuple[float, float]:
    """(per block, per stage) seconds of the runtime model's forward + backward beyond its
    kernels: ``fived.model`` at a tiny width (2 tokens, hidden 8) with 1 and 3 blocks, where
    every kernel is ~free and what remains is dispatch and autograd."""
    import torch

    from ..config import ModelConfig
    from ..model.llama import build_model

    times = {}
    for layers in (1, 3):
        cfg = ModelConfig(name="probe", vocab=8, hidden=8, layers=layers, heads=2, kv_heads=1,
                          ffn=8, seq_len=2)
        model = build_model(cfg, 0)
        x = torch.zeros(1, 2, dtype=torch.long)
        pos = torch.arange(2)

        def step(model=model, x=x, pos=pos):
            model(x, pos, x).backward()

        if sync is not None:
            sync()
        times[layers] = time_hot(step, seconds * 2)
    block = max((times[3] - times[1]) / 2, 0.0)
    return block, max(times[1] - block, 0.0)


def fit_gemm(rows: list[tuple[int, int, int, float]], overhead: float) -> dict:
    """With the measured per-op overhead subtracted, the ceiling P per d0 on a grid (the
    median of each shape's implied P), the best d0 by the median relative error."""
    best = None
    for d0 in (4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0):
        x = [2.0 * m * n * k / ((m / (m + d0)) * (n / (n + d0)) * (k / (k + d0)))
             for m, n, k, _ in rows]
        ps = [xi / max(r[3] - overhead, 1e-9) for xi, r in zip(x, rows)]
        p = statistics.median(ps)
        err = statistics.median(abs((overhead + xi / p) / r[3] - 1) for xi, r in zip(x, rows))
        if best is None or err < best["error"]:
            best = {"d0": d0, "peak": p, "overhead": overhead, "error": err}
    return best


def _probe_model():
    from ..config import ModelConfig

    # vocabulary 256: the built-in corpus is bytes
    return ModelConfig(name="probe", vocab=256, hidden=8, layers=1, heads=2, kv_heads=1, ffn=8,
                       seq_len=2)


def step_overhead(par, steps: int = 5) -> float | None:
    """The trainer's per-step cost outside the model: ``fived train`` of a one-block model of
    width 8 in this layout (the median step after the first), or None when the layout does
    not fit such a model."""
    from dataclasses import replace as dc_replace

    from ..config import ConfigError, TrainConfig, validate
    from ..ranks.launch import run_local
    from ..train.trainer import train_rank

    m = _probe_model()
    per_replica = par.micro_batches
    train = TrainConfig(model="probe", steps=steps, global_batch=par.dp * par.ep * per_replica,
                        warmup=0)
    p = dc_replace(par, pp_layers=())
    try:
        validate(m, p, train, p.world_size)
    except ConfigError:
        return None
    outs = run_local(train_rank, p.world_size, (m, p, train, False), timeout=600.0)
    secs = [h["seconds"] for h in outs[0]["history"][1:]]
    return statistics.median(secs)


def time_sharing(ranks: int, threads: int, cores: int) -> tuple[int, int]:
    """(probing processes, slots) for ``ranks`` ranks of ``threads`` threads on ``cores``:
    ``slots`` ranks run at once, each on its own cores. More ranks than slots run
    time-shared; a short timing would catch a process alone on its core, so the probes run
    as many processes as there are slots, and the planner bounds the step by the ranks' busy
    time over the slots (``Hardware.cores``)."""
    slots = max(1, cores // threads)
    return min(ranks, slots), slots


def this_machine(bench_json: str | None = None, ranks: int = 1, seconds: float = 0.03,
                 par=None, model=None, micro_batch: int = 0, clock=None):
    """The measured preset (``fived.ledger.hardware.Hardware``) for ``ranks`` local ranks;
    with a layout (``par``, ``model``, ``micro_batch``, the ``clock`` options) its GEMMs
    (``roofline.gemm_shapes``) are timed too and kept as the preset's ``gemm_table``, and its
    other kernels traced and timed (``kernels.measure``) where the block can be traced."""
    import os

    from ..ledger import hardware
    from ..ledger.roofline import gemm_shapes
    from ..ranks.launch import run_local, threads_per_rank

    base = hardware.this_machine(bench_json)
    shapes, layout = None, None
    if model is not None:
        if kernels.traceable(model, par):  # the attention is one traced kernel, not two GEMMs
            layout = (model, par, micro_batch, seconds / 2)
            clock = replace(clock, attention="flash")
        shapes = gemm_shapes(model, par, micro_batch, clock)
    probes, slots = time_sharing(ranks, threads_per_rank(ranks), os.cpu_count() or 1)
    if probes > 1:
        outs = run_local(_rank_sweep, probes, (seconds, None), timeout=300.0)
        tabs = run_local(_rank_sweep, probes, (seconds, shapes, layout), timeout=600.0
                         ) if shapes else []
    else:
        import torch

        old = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(ranks))
        try:
            outs = [sweep(seconds)]
            outs[0]["framework"] = framework_overhead(seconds)
            tabs = [sweep(seconds, shapes)] if shapes else []
            if tabs and layout is not None:
                tabs[0]["eager"] = kernels.measure(*layout)
        finally:
            torch.set_num_threads(old)
    n = len(SHAPES)
    rows = [(*SHAPES[i], statistics.median(o["rows"][i][3] for o in outs)) for i in range(n)]
    fit = fit_gemm(rows, statistics.median(o["overhead"] for o in outs))
    bw = statistics.median(o["bw"] for o in outs)
    table = tuple((*shapes[i], statistics.median(o["rows"][i][3] for o in tabs))
                  for i in range(len(shapes))) if shapes else ()
    block = statistics.median(o["framework"][0] for o in outs)
    stage = statistics.median(o["framework"][1] for o in outs)
    eager: tuple = ()
    if tabs and "eager" in tabs[0]:
        eager = tuple(statistics.median(v) for v in zip(*(kernels.as_tuple(o["eager"])
                                                           for o in tabs)))
        # each timed kernel carries its own dispatch: leave only the rest (autograd, Python)
        calls = statistics.median(o["eager"]["kernels"] for o in tabs)
        block = max(0.0, block - calls * fit["overhead"])
    step = step_overhead(par) if par is not None else None
    # the probe's own block and stage run every micro-batch: what is left is per step
    step = max(0.0, step - par.micro_batches * (block + stage)) if step is not None else 0.0
    return replace(base, gemm_table=table, block_overhead=block, stage_overhead=stage,
                   step_overhead=step, eager=eager,
                   peak_flops=fit["peak"], peak_fp32=fit["peak"], gemm_eff=1.0,
                   gemm_d0=fit["d0"], overhead=0.0, hbm_bw=bw, mem_eff=1.0,
                   attn_eff=1.0, cores=slots,
                   note=base.note + f"; fp32 matmul sweep on {probes} process(es) for "
                   f"{ranks} rank(s)" + (f" ({slots} run at once: time-shared)"
                                         if ranks > slots else "")
                   + f": ceiling "
                   f"{fit['peak'] / 1e9:.1f} GFLOP/s, d0 {fit['d0']:g}, "
                   f"{fit['overhead'] * 1e6:.1f} µs per matmul call (median error "
                   f"{fit['error']:.0%}); runtime overhead {block * 1e3:.2f} ms per block, "
                   f"{stage * 1e3:.2f} ms per stage, {step * 1e3:.1f} ms per step; "
                   f"memory {bw / 1e9:.1f} GB/s"
                   + (f"; {len(table)} GEMM shapes of the layout timed" if table else "")
                   + (f"; eager kernels traced and timed: {eager_note(eager)}" if eager
                      else ""))


def eager_note(e: tuple) -> str:
    return (f"block attention {e[0] * 1e3:.2f}+{e[1] * 1e3:.2f} ms, element-wise "
            f"{e[2] * 1e3:.2f}+{e[3] * 1e3:.2f} ms (forward+backward per micro-batch)")
