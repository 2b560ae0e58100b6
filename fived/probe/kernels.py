"""``--gpu this-machine``: every kernel the eager runtime runs outside its GEMMs, timed at its shape.

On a CPU the runtime's element-wise work is not bound by memory bandwidth alone: each eager op
is its own OpenMP region (a wake-up of the threads, ~5 µs active, ~80 µs with
``OMP_WAIT_POLICY=PASSIVE``), autograd adds kernels of its own (gradient accumulation, the
zeros and copies of slice backward), and the attention core is PyTorch's CPU flash kernel,
far below the matmul rate at small head dimensions. So instead of counting bytes, the probe

1. records, with a ``TorchDispatchMode``, every aten op of the runtime model's (``fived.model``)
   forward and backward at the rank's micro-batch shape, for 1 and for 2 blocks: the
   difference is one block, the rest the stages (the embedding on the first, the final norm,
   head and loss on the last);
2. times each distinct op (its function, shapes, strides, dtypes and arguments) alone, twice:
   hot (called again and again, its inputs in cache) and cold (the caches flushed by a 48 MB
   write before each call). Inside a step an op's inputs are partly fresh from the op before it
   and partly long evicted (weights, saved activations), so it runs between the two; the clock
   takes the midpoint, and the spread is the estimate's own uncertainty;
3. sums the views-free ops per phase: (attention, element-wise) × (forward, backward) for a
   block, and forward/backward of the first and the last stage.

GEMMs (``mm``, ``addmm``, ``bmm``) are left to the roofline's GEMM table (``fived.probe.machine``),
timed the same way. A tp rank's block is traced as a whole block with its heads and MLP cut
tp ways (``local_model``); context and expert cuts are not traced (they fall back to the
roofline's byte count).
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import replace

GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
FLUSH_FLOATS = 12 * 2**20  # 48 MB: more than this machine's last-level cache


def traceable(m, par) -> bool:
    """Whether the runtime block of this layout is a whole model's block at its local shape:
    a smaller batch, and with tp the heads and the MLP cut tp ways (``local_model``)."""
    return par.cp == 1 and par.ep == 1 and not m.is_moe


def local_model(m, par):
    """The model whose whole block runs the kernels of one tp rank's block: q heads, k/v
    heads (replicated below tp) and the MLP cut tp ways, the vocabulary too (the head's
    columns and the cross-entropy's logits). Sequence parallelism's shorter norms and the
    collectives' own copies are not in it."""
    tp = par.tp
    if tp == 1:
        return m
    return replace(m, heads=m.heads // tp, kv_heads=max(1, m.kv_heads // tp), ffn=m.ffn // tp,
                   vocab=max(1, m.vocab // tp))


def _spec(x):
    import torch

    if isinstance(x, (list, tuple)):
        return ("L" if isinstance(x, list) else "U", tuple(_spec(v) for v in x))
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), str(x.dtype).split(".")[1],
                x.storage_offset())
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ("O", x)
    return x


def _build(s):
    import torch

    if isinstance(s, tuple) and s and s[0] == "T":
        _, shape, stride, dt, off = s
        dtype = getattr(torch, dt)
        n = off + sum((d - 1) * st for d, st in zip(shape, stride)) + 1 if all(shape) else 1
        base = torch.empty(n, dtype=dtype)
        base.normal_() if dtype.is_floating_point else base.zero_()  # index 0 is always valid
        return base.as_strided(shape, stride, off)
    if isinstance(s, tuple) and s and s[0] == "O":
        return s[1]
    if isinstance(s, tuple) and s and s[0] in ("L", "U"):
        v = [_build(x) for x in s[1]]
        return v if s[0] == "L" else tuple(v)
    return s


def _recorder():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not func.is_view:
                self.calls[(func, _spec(list(args)), _spec(sorted(kwargs.items())))] += 1
            return out

    return Record


def trace(m, par, b: int) -> dict[str, collections.Counter]:
    """{"fwd1", "bwd1", "fwd2", "bwd2"}: the ops of the model with 1 and 2 blocks."""
    import torch

    from ..config import precision_of
    from ..model.llama import build_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        precision_of(par)]  # this machine's kernels: auto is its cpu's, fp32
    rec = _recorder()
    out = {}
    for layers in (1, 2):
        cfg = replace(local_model(m, par), layers=layers)
        model = build_model(cfg, 0, dtype=dtype)
        x = torch.zeros(b, cfg.seq_len, dtype=torch.long)
        pos = torch.arange(cfg.seq_len)
        model(x, pos, x).backward()  # warm: lazy initialisations stay out of the count
        for p in model.parameters():
            p.grad = None
        fwd, bwd = rec(), rec()
        with fwd:
            loss = model(x, pos, x)
        with bwd:
            loss.backward()
        out[f"fwd{layers}"], out[f"bwd{layers}"] = fwd.calls, bwd.calls
    return out


def time_hot(fn, seconds: float, trials: int = 5) -> float:
    """Median over ``trials`` of the mean time of calls filling ``seconds / trials``."""
    fn()
    out = []
    for _ in range(trials):
        reps, t0 = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= seconds / trials and reps >= 2:
                out.append(dt / reps)
                break
    return statistics.median(out)


def time_cold(fn, flush, calls: int = 9) -> float:
    """Median of single calls, each after a write of ``flush`` (more than the caches hold)."""
    fn()
    out = []
    for _ in range(calls):
        flush.fill_(1.0)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _midpoint(func, key, flush, seconds: float, sync) -> float | None:
    """The op alone on inputs of its recorded shapes: (hot + cold) / 2 seconds. Every rank
    calls ``sync`` the same number of times, whether the op runs or not."""
    try:
        args, kwargs = _build(key[1]), dict(_build(key[2]))
        func(*args, **kwargs)
        ok = True
    except (RuntimeError, ValueError, IndexError, TypeError):
        ok = False
    sync()
    hot = time_hot(lambda: func(*args, **kwargs), seconds) if ok else 0.0
    sync()
    cold = time_cold(lambda: func(*args, **kwargs), flush) if ok else 0.0
    return (hot + cold) / 2 if ok else None


def _kind(func) -> str:
    name = func.overloadpacket.__name__
    if name in GEMMS:
        return "gemm"
    return "attn" if "scaled_dot_product" in name else "ew"


def measure(m, par, b: int, seconds: float = 0.02, sync=None) -> dict:
    """Seconds per micro-batch of the non-GEMM kernels (midpoint of hot and cold):
    block attention and element-wise, forward and backward; first- and last-stage extras;
    and ``kernels``: the ops of one block (GEMMs included), for the dispatch the tiny-model
    probe already counts."""
    import torch

    sync = sync or (lambda: None)
    tr = trace(m, par, b)
    flush = torch.empty(FLUSH_FLOATS)
    seen: dict = {}
    out = collections.defaultdict(float)
    out["kernels"] = out["untimed"] = 0.0
    for phase in ("fwd", "bwd"):
        one, two = tr[phase + "1"], tr[phase + "2"]
        for key, n2 in two.items():
            func = key[0]
            kind = _kind(func)
            block = n2 - one.get(key, 0)
            out["kernels"] += block
            if kind == "gemm":
                continue
            if key not in seen:
                seen[key] = _midpoint(func, key, flush, seconds, sync)
            t = seen[key]
            if t is None:  # an op that cannot run on made-up inputs: counted, not timed
                out["untimed"] += n2
                continue
            out[f"block_{kind}_{phase}"] += block * t
            stage = n2 - 2 * block  # what the 1-block model runs beyond its block
            name = func.overloadpacket.__name__
            out[f"{'first' if name.startswith('embedding') else 'last'}_{phase}"] += stage * t
    return dict(out)


def as_tuple(d: dict) -> tuple[float, ...]:
    """The order ``Hardware.eager`` keeps them in."""
    keys = ("block_attn_fwd", "block_attn_bwd", "block_ew_fwd", "block_ew_bwd", "first_fwd",
            "first_bwd", "last_fwd", "last_bwd")
    return tuple(d.get(k, 0.0) for k in keys)
