"""The pipeline executor: runs this rank's action list (``schedules.py``) once per step over its
``StageModel`` (this rank's chunks of the layer stack, ``stage.split``, under global names).

* **p2p without metadata.** Every message between stages is a (micro_batch, seq_local, hidden)
  tensor in the model dtype, ``seq_local = seq_len / cp (/ tp with sequence parallelism)``, so
  receive buffers are allocated from the config. Sends are posted asynchronously through
  ``fived.comm.ops.exchange`` on ``grid["pp"]`` (bytes charged to ``pp``); the wire is FIFO per
  (sender, receiver) pair, and since every rank knows every rank's list, a receiver posts its
  receives in the order its peer sends them and keeps one receive in flight per peer (the
  next message is prefetched while it computes). ``schedules.check`` proves the lists are
  deadlock-free under exactly this model (sends never block, receives wait for their send).
* **Freeing.** A stage output's storage is released (``untyped_storage().resize_(0)``; the
  autograd graph keeps its metadata) once its send has completed (checked after every action,
  oldest send first per peer): the last op of a stage is a residual add, which saves nothing
  for backward. Input gradients likewise.
* **Loss.** The last stage computes Σ CE over the micro-batch's local tokens and backpropagates
  ``loss · scale`` (scale = 1/global_tokens): the summed gradients equal the one-rank gradient
  for any number of micro-batches and any schedule.
* **dp / ZeRO.** ``engine.set_last_micro(last)`` is called before every backward action;
  ``last`` is True on the action that does the final gradient accumulation of a chunk's
  parameters (its last B; for split backwards also its last W), so the engine's bucketed
  reduction counts each parameter once and starts only after the step's last backward.
* **ZeRO-3.** ``engine.begin_compute(chunk, kind)`` / ``end_compute`` wrap every F, B and W:
  ZeRO-3 all-gathers the chunk's parameters there (once per step or per micro-batch,
  ``--zero3-pp-gather``; ``fived.parallel.data.zero3``).
* **Zero-bubble split (ZB-H1, ZB-V, DualPipe-V).** During a split schedule's forward a ``TorchFunctionMode``
  routes every ``F.linear(x, W)`` with W a stage parameter to ``F.linear(x, W.detach())`` and
  records (x, y, W). B is ``torch.autograd.backward(root, grad, inputs=[stage input, every y,
  every parameter])``: it computes the input gradient, dL/dy of each linear and the gradients
  of the parameters that are not linear weights (norms, embedding), but no weight gradient
  (the weights are detached from the graph). W computes dW = dyᵀ·x for each recorded linear
  (the kernel autograd's mm backward runs, so the same bits) and accumulates it as autograd's
  AccumulateGrad would (``W.grad = dW``, or ``W.grad += dW``), then runs W's post-accumulate
  hooks (the engines' bucket hooks): no autograd pass for the weights.
  Under full recompute the forward is not split (a checkpointed block must save the same
  tensors when it reruns): every B is the whole backward and W has nothing to do.
  A B directly followed by its own W in the list (DualPipe-V's full backwards, written
  ``BW``; a first stage's B, which sends nothing) is run as one ordinary backward, its forward
  without the mode, and the W is empty.
* **Forward only (evaluation).** ``run_forward`` runs ``schedules.forward_only`` of the
  step's schedule (its F, SEND_F and RECV_F actions, same order) under ``torch.no_grad``: the
  activations go stage to stage over the same p2p, each freed once sent, the last stage sums
  the token loss; no backward, no gradient touched, ZeRO-3 gathers around each F only.
* **Measurement.** Per step: compute seconds (F/B/W), comm seconds (posting sends, and
  receive waits after the peer had sent), idle (the rest of the pipeline makespan, which is
  max(end) − min(start) over the pp ranks), measured bubble = 1 − compute/makespan, and peak
  live micro-batches per stage. Send timestamps are exchanged on a ``metrics`` group.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ... import phases, schedules
from ...comm import ops
from ...config import ModelConfig, ParallelConfig
from ...model.documents import micro_positions
from ...model.llama import Transformer


class _SplitLinear(TorchFunctionMode):
    """Detach stage weights inside F.linear and record (x, y, W) for the deferred W pass."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.weights = weights
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x = args[0]
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            if w is not None and id(w) in self.weights:
                b = args[2] if len(args) > 2 else kwargs.get("bias")
                y = func(x, w.detach(), b)
                if y.requires_grad:
                    self.records.append((x.detach(), y, w))
                    return y
        return func(*args, **kwargs)


def _weight_grads(records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """The deferred W: dW = dyᵀ·x per recorded linear (summed in record order over the uses of
    one weight, as autograd sums a leaf's incoming gradients), accumulated as AccumulateGrad
    does (``W.grad = dW``, or ``W.grad += dW``), then W's post-accumulate hooks, once."""
    dws: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for x, y, w in records:
            if y.grad is None:
                continue
            dw = y.grad.reshape(-1, y.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(y.dtype)
            prev = dws.get(id(w))
            dws[id(w)] = (w, dw if prev is None else prev[1] + dw)
        for w, dw in dws.values():
            if w.grad is None:
                w.grad = dw
            else:
                w.grad += dw
            # the hooks register_post_accumulate_grad_hook keeps on the tensor (torch's own dict)
            for hook in (w._post_accumulate_grad_hooks or {}).values():
                hook(w)


class _P2P:
    """Activation/gradient messages on the pp group; FIFO per peer, one receive in flight."""

    def __init__(self, group: Any, sched: schedules.Schedule, rank: int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, instant: bool = False):
        self.group, self.shape, self.dtype, self.device = group, shape, dtype, device
        self.instant = instant  # every send counts as done once posted (fake backend)
        self.expected: dict[int, list[tuple]] = defaultdict(list)
        for src, acts in enumerate(sched.ranks):
            for a in acts:
                if (a.kind in ("SEND_F", "SEND_B") and schedules.peer(a, sched) == rank
                        and src != rank):
                    self.expected[src].append(schedules.message(a))
        self.reset()

    def reset(self) -> None:
        self.next = defaultdict(int)  # next message index to post, per peer
        self.posted: dict[int, deque] = defaultdict(deque)
        self.arrived: dict[tuple, torch.Tensor] = {}
        self.sends: dict[int, deque] = defaultdict(deque)  # (handle, tensors to free), per peer
        self.send_times: list[float] = []
        self.waits: list[tuple[tuple, float, float]] = []  # (message, start, end)

    def _post(self, src: int) -> bool:
        i = self.next[src]
        if i >= len(self.expected[src]):
            return False
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        h = ops.exchange(self.group, [], [(buf, src)], async_op=True)
        self.posted[src].append((self.expected[src][i], buf, h))
        self.next[src] = i + 1
        return True

    def recv(self, msg: tuple, src: int) -> torch.Tensor:
        t0 = time.time()
        while msg not in self.arrived:
            if not self.posted[src] and not self._post(src):
                raise RuntimeError(f"pipeline: {msg} is not among the messages from rank {src}")
            key, buf, h = self.posted[src].popleft()
            h.wait()
            self.arrived[key] = buf
        self.waits.append((msg, t0, time.time()))
        if not self.posted[src]:
            self._post(src)  # prefetch the next message from this peer
        return self.arrived.pop(msg)

    def send(self, t: torch.Tensor, dst: int, free: list[torch.Tensor]) -> None:
        self.send_times.append(time.time())
        h = ops.exchange(self.group, [(t, dst)], [], async_op=True)
        self.sends[dst].append((h, free))
        self.poll()

    def poll(self) -> None:
        """Free the storage of the sends that have completed, oldest first per peer (the wire
        is FIFO per peer: the first one still in flight ends the check for that peer)."""
        for pending in self.sends.values():
            while pending and (self.instant or _done(pending[0][0])):
                _free(*pending.popleft())

    def drain(self) -> None:
        for pending in self.sends.values():
            while pending:
                _free(*pending.popleft())


def _done(h: Any) -> bool:
    return h.work is None or all(w.is_completed() for w in h.work)


def _free(h: Any, tensors: list[torch.Tensor]) -> None:
    h.wait()
    for t in tensors:
        t.untyped_storage().resize_(0)


class StageModel(nn.Module):
    """This rank's model: its v chunks (stages r, r+p, ...) under global parameter names.

    The chunks are parts of one ``Transformer``; this container registers their embedding,
    layers, final norm and head under the names they have in the whole model.
    ``forward(x, positions, targets, chunk=c)`` runs chunk c.
    """

    def __init__(self, chunks: list[Transformer], stage_ids: list[int]):
        super().__init__()
        self.stage_ids = stage_ids
        self.chunk_models = chunks
        self.first, self.last = chunks[0].first, chunks[-1].last
        embed = [c.embed_tokens for c in chunks if hasattr(c, "embed_tokens")]
        if embed:  # the first stage's; the last stage's too (tied head, multi-token prediction)
            self.embed_tokens = embed[0]
        self.layers = nn.ModuleDict()
        for c in chunks:
            for k, blk in c.layers.items():
                self.layers[k] = blk
        if self.last:
            self.norm, self.lm_head = chunks[-1].norm, chunks[-1].lm_head
            if hasattr(chunks[-1], "mtp"):
                self.mtp = chunks[-1].mtp

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.layers]

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                targets: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        return self.chunk_models[chunk](x, positions, targets)


class PipelineExecutor:
    """Runs this rank's schedule over its ``StageModel`` (``stage.split``'s chunks)."""

    def __init__(self, cfg: ModelConfig, par: ParallelConfig, grid: Any, stage: StageModel,
                 dtype: torch.dtype, sched: schedules.Schedule | None = None):
        self.cfg, self.par, self.grid, self.stage, self.dtype = cfg, par, grid, stage, dtype
        self.group = grid["pp"]
        self.pp = grid.degrees["pp"]
        self.rank = grid.coords()["pp"]
        v = par.virtual_stages if par.schedule in ("interleaved",) + schedules.V_SHAPED else 1
        self.schedule = sched or schedules.build(par.schedule, self.pp, par.micro_batches, v)
        schedules.check(self.schedule)
        self.actions = self.schedule.ranks[self.rank]
        self.num_stages = self.schedule.stages
        self.chunk_of = {s: c for c, s in enumerate(self.stage.stage_ids)}
        self.split = self.schedule.split_backward
        self.measure = True
        self.instant_sends = False  # the dry run: a fake backend's send is done when posted
        self.delay: dict[str, float] = {}  # test knob: extra seconds slept per F/B/W action
        self.stats: dict[str, Any] = {}
        # the final accumulation of each chunk's parameters (set_last_micro True there)
        self.final = set()
        for kind in ("B", "W") if self.split else ("B",):
            for s in self.stage.stage_ids:
                idx = [i for i, a in enumerate(self.actions) if a.kind == kind and a.stage == s]
                self.final.add(idx[-1])
        # a B directly followed by its own W (a full backward: DualPipe-V's "BW", or a stage
        # with no gradient to send) runs as one ordinary backward pass; W then has nothing left
        acts = self.actions
        self.fused = {(a.mb, a.stage) for i, (a, b) in enumerate(zip(acts, acts[1:]))
                      if self.split and a.kind == "B" and b == schedules.Action("W", a.mb, a.stage)
                      and (i in self.final) == (i + 1 in self.final)}
        # the chunk of the next F or B after each action (ZeRO-3 prefetches it)
        self.next_chunk: dict[int, int | None] = {}
        upcoming = None
        for i in range(len(acts) - 1, -1, -1):
            self.next_chunk[i] = upcoming
            if acts[i].kind in ("F", "B"):
                upcoming = self.chunk_of[acts[i].stage]
        if self.split and par.recompute == "full":
            # a checkpointed block recomputes its linears with the real weights (it would save
            # other tensors than the split forward did): every B is the whole backward there,
            # each chunk's last B its final accumulation, and W has nothing left to do
            self.fused = {(a.mb, a.stage) for a in acts if a.kind == "B"}
        self.metrics = replace(self.group, name="metrics")

    # ------------------------------------------------------------------ shapes
    def activation_shape(self, micro_batch: int) -> tuple[int, int, int]:
        seq = self.cfg.seq_len // self.par.cp
        if self.par.sequence_parallel:
            seq //= self.par.tp
        return (micro_batch, seq, self.cfg.hidden)

    def activation_bytes(self, micro_batch: int) -> int:
        n = 1
        for d in self.activation_shape(micro_batch):
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    # ------------------------------------------------------------------ one step
    def run(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor, scale: float,
            engine: Any) -> torch.Tensor:
        """All micro-batches of the step; returns this rank's summed token loss (0 unless it
        holds the last stage)."""
        m = self.par.micro_batches
        xs, ys = x.chunk(m), y.chunk(m)
        pos = micro_positions(positions, m)  # --doc-mask: each micro-batch's own rows
        mbs = xs[0].shape[0]
        p2p = getattr(self, "_p2p", None)
        if p2p is None:
            p2p = self._p2p = _P2P(self.group, self.schedule, self.rank,
                                   self.activation_shape(mbs), self.dtype, x.device,
                                   self.instant_sends)
        p2p.reset()
        S_, sched = self.num_stages, self.schedule
        local: dict[tuple, torch.Tensor] = {}  # hand-offs between two stages of this rank
        nothing = lambda *args: None  # noqa: E731 (an engine without ZeRO-3 gathers)
        begin = getattr(engine, "begin_compute", nothing)
        end_ = getattr(engine, "end_compute", nothing)
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        grads: dict[tuple[int, int], torch.Tensor] = {}
        records: dict[tuple[int, int], list] = {}
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        weights = {id(p) for p in self.stage.parameters() if p.requires_grad}
        chunk_params = [[p for p in c.parameters() if p.requires_grad]
                        for c in self.stage.chunk_models]
        compute = 0.0
        live: dict[int, int] = defaultdict(int)
        peak: dict[int, int] = defaultdict(int)
        if self.measure:
            ops.barrier(self.metrics)
        start = time.time()
        for i, a in enumerate(self.actions):
            key = (a.mb, a.stage)
            c = self.chunk_of[a.stage]
            if a.kind in schedules.COMM and schedules.is_local(a, sched):  # V layout: stage p−1 → p
                if a.kind == "SEND_F":
                    local[schedules.message(a)] = outputs[key].detach()
                elif a.kind == "SEND_B":
                    local[schedules.message(a)] = inputs.pop(key).grad
                elif a.kind == "RECV_F":
                    inputs[key] = local.pop(schedules.message(a)).requires_grad_()
                else:
                    grads[key] = local.pop(schedules.message(a))
            elif a.kind == "RECV_F":
                inputs[key] = p2p.recv(schedules.message(a), schedules.peer(a, sched)).requires_grad_()
            elif a.kind == "RECV_B":
                grads[key] = p2p.recv(schedules.message(a), schedules.peer(a, sched))
            elif a.kind == "SEND_F":
                out = outputs[key]
                p2p.send(out.detach(), schedules.peer(a, sched), [out])
            elif a.kind == "SEND_B":
                g = inputs.pop(key).grad
                p2p.send(g, schedules.peer(a, sched), [g])
            else:
                t0 = time.time()
                phases.compute(a.kind, a.mb, a.stage)
                begin(c, a.kind)
                if a.kind == "F":
                    inp = xs[a.mb] if a.stage == 0 else inputs[key]
                    last = a.stage == S_ - 1
                    if self.split and key not in self.fused:
                        mode = _SplitLinear(weights)
                        with mode:
                            out = self.stage(inp, pos[a.mb], ys[a.mb] if last else None,
                                             chunk=c)
                        records[key] = mode.records
                        del mode  # W frees the records: nothing else may hold them
                    else:
                        out = self.stage(inp, pos[a.mb], ys[a.mb] if last else None, chunk=c)
                    if last:
                        total += out.detach().float()
                        out = out * scale
                    outputs[key] = out
                    live[a.stage] += 1
                    peak[a.stage] = max(peak[a.stage], live[a.stage])
                elif a.kind == "B":
                    engine.set_last_micro(i in self.final)
                    out = outputs.pop(key)
                    g = grads.pop(key, None)
                    if self.split and key not in self.fused:
                        rec = records[key]
                        extra = [t for t in ([inputs[key]] if key in inputs else [])]
                        extra += [r[1] for r in rec] + chunk_params[c]
                        torch.autograd.backward(out, g, inputs=extra)
                        del rec, extra  # the records alone keep the stash until W
                    else:
                        torch.autograd.backward(out, g)
                        if not self.split:
                            live[a.stage] -= 1
                    if a.stage > 0 and inputs[key].grad is None:
                        inputs[key].grad = torch.zeros_like(inputs[key])
                    del out, g
                elif a.kind == "W" and key in self.fused:
                    live[a.stage] -= 1  # its B was the whole backward
                elif a.kind == "W":
                    engine.set_last_micro(i in self.final)
                    _weight_grads(records.pop(key))
                    live[a.stage] -= 1
                end_(c, a.kind, self.next_chunk[i])
                if self.delay.get(a.kind):
                    time.sleep(self.delay[a.kind])
                compute += time.time() - t0
            p2p.poll()
        p2p.drain()
        end = time.time()
        if self.measure:
            self.stats = self._measure(p2p, start, end, compute, dict(peak))
        return total

    # ------------------------------------------------------------------ forward only
    def run_forward(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor,
                    engine: Any) -> torch.Tensor:
        """The forward half of the step's schedule under ``torch.no_grad`` (evaluation):
        this rank's summed token loss (0 unless it holds the last stage). No autograd graph,
        no backward action, no gradient buffer touched; ``engine.begin_compute`` /
        ``end_compute`` wrap each F (ZeRO-3's gathers)."""
        fwd = getattr(self, "_fwd", None)
        if fwd is None:
            sched = schedules.forward_only(self.schedule)
            schedules.check(sched)
            acts = sched.ranks[self.rank]
            nxt: dict[int, int | None] = {}
            upcoming = None
            for i in range(len(acts) - 1, -1, -1):
                nxt[i] = upcoming
                if acts[i].kind == "F":
                    upcoming = self.chunk_of[acts[i].stage]
            fwd = self._fwd = (sched, acts, nxt, {})
        sched, acts, nxt, p2ps = fwd
        m = self.par.micro_batches
        xs, ys = x.chunk(m), y.chunk(m)
        pos = micro_positions(positions, m)
        shape = self.activation_shape(xs[0].shape[0])
        p2p = p2ps.get(shape)
        if p2p is None:
            p2p = p2ps[shape] = _P2P(self.group, sched, self.rank, shape, self.dtype, x.device)
        p2p.reset()
        nothing = lambda *args: None  # noqa: E731 (an engine without ZeRO-3 gathers)
        begin = getattr(engine, "begin_compute", nothing)
        end_ = getattr(engine, "end_compute", nothing)
        last = self.num_stages - 1
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        local: dict[tuple, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        with torch.no_grad():
            for i, a in enumerate(acts):
                key = (a.mb, a.stage)
                if a.kind == "SEND_F":
                    out = outputs.pop(key)
                    if schedules.is_local(a, sched):  # V layout: stage p−1 → p on this rank
                        local[schedules.message(a)] = out
                    else:
                        p2p.send(out, schedules.peer(a, sched), [out])
                elif a.kind == "RECV_F":
                    inputs[key] = (local.pop(schedules.message(a)) if schedules.is_local(a, sched)
                                   else p2p.recv(schedules.message(a), schedules.peer(a, sched)))
                else:  # F
                    c = self.chunk_of[a.stage]
                    begin(c, "F")
                    inp = xs[a.mb] if a.stage == 0 else inputs.pop(key)
                    out = self.stage(inp, pos[a.mb], ys[a.mb] if a.stage == last else None,
                                     chunk=c)
                    if a.stage == last:
                        total += out.float()
                    else:
                        outputs[key] = out
                    end_(c, "F", nxt[i])
                p2p.poll()
            p2p.drain()
        return total

    # ------------------------------------------------------------------ measurement
    def _measure(self, p2p: _P2P, start: float, end: float, compute: float,
                 peak: dict[int, int]) -> dict[str, Any]:
        sched = self.schedule

        def remote_sends(acts: list[schedules.Action]) -> list[schedules.Action]:
            return [a for a in acts if a.kind in ("SEND_F", "SEND_B")
                    and not schedules.is_local(a, sched)]

        n_send = max(len(remote_sends(acts)) for acts in sched.ranks)
        dev = p2p.device  # the metrics all-gather runs on the rank's device (nccl: cuda)
        vec = torch.full((2 + n_send,), float("nan"), dtype=torch.float64, device=dev)
        vec[0], vec[1] = start, end
        if p2p.send_times:
            vec[2:2 + len(p2p.send_times)] = torch.tensor(p2p.send_times, dtype=torch.float64,
                                                         device=dev)
        out = torch.zeros(self.pp * vec.numel(), dtype=torch.float64, device=dev)
        ops.all_gather_into(out, vec, self.metrics)
        rows = out.view(self.pp, -1).cpu()
        t_begin, t_end = float(rows[:, 0].min()), float(rows[:, 1].max())
        makespan = max(t_end - t_begin, 1e-12)
        sent_at: dict[tuple, float] = {}
        for r, acts in enumerate(sched.ranks):
            for k, a in enumerate(remote_sends(acts)):
                sent_at[schedules.message(a)] = float(rows[r, 2 + k])
        comm = 0.0
        for msg, t0, t1 in p2p.waits:
            comm += max(0.0, t1 - max(t0, sent_at.get(msg, t0)))
        idle = max(0.0, makespan - compute - comm)
        return {"compute_s": compute, "comm_s": comm, "idle_s": idle, "makespan_s": makespan,
                "bubble": 1.0 - compute / makespan, "peak_live": peak,
                "peak_live_rank": max(schedules.peak_live_rank(self.schedule)[self.rank], 0)}
