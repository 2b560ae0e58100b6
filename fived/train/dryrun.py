"""The dry run: one rank of any layout, built and stepped for real on fake tensors.

``fived train --dry-run --ranks R,R,...|distinct`` runs, for each named rank of the layout, in
this one process:

1. the ``fake`` process-group backend (``FakeStore``,
   ``torch.testing._internal.distributed.fake_pg``) at the layout's world size, this rank's
   number — every collective returns at once and moves nothing — and only this rank's groups
   (``new_group(..., use_local_synchronization=True)``), so a rank of 16,384 costs no more than
   a rank of 8;
2. under ``FakeTensorMode`` (no storage is allocated: a tensor is its shape, dtype and device)
   the same ``Trainer`` a real run builds — the whole plain model (weights not drawn: fake
   tensors have no values), cut by ``parallelize`` into this rank's pipeline stage, tp/cp/ep
   pieces, and the dp/ZeRO engine with its flat buffers, fp32 masters and Adam state;
3. one full training step through the same code: the micro-batches through the pipeline
   executor (or the plain loop), the engine's bucketed reductions, the gradient norm's
   collectives, the AdamW step and the parameter all-gathers;

and records what the ledger predicts: model-state bytes (``engine.memory()``, and again from the
storages themselves, ``storage_states``), the bytes every collective through ``fived.comm`` sent
(per group and per group/op, ``traffic_by_op``), and the peak of live activation bytes — every
distinct storage autograd saved for backward (``untyped_storage().nbytes()``, once per storage),
counted from the moment it is saved until its last reference dies (``LiveSaved``), the quantity
``fived.ledger.memory.activations`` predicts (pipeline in-flight micro-batches included). It
writes the same metrics JSONL as a real run (plus ``ranks``, ``memory_storage_per_rank`` and
``activation_peak_per_rank``), so ``fived ledger --check FILE`` compares model states (both
counts), traffic per group and per (group, op) and ZeRO-2's ``buffers`` exactly and the
activation peak within 0.5 % or 16 KiB (``fived.ledger.verify``).

The attention is the runtime's own ``layers.causal_attention``; only SDPA on meta tensors is sent
to the flash kernel's op (``flash_on_meta``). MoE layers run their own ``MoE.moe``; only its one
data-dependent step, ``MoE.assign`` (which assignments each expert gets), is uniform routing
here, and the ep dispatch sends the uniform counts (``uniform_routing``).

The device. Every tensor is made on the rank's device. The dry run uses ``meta``, a device that
is not the CPU: a tensor left on the CPU by mistake meets a meta tensor and the fake mode raises
a device mismatch — the test that the GPU path puts everything on its device. (The ``cuda``
device itself cannot be used here: in this CPU-only torch build autograd needs a CUDA device
guard and aborts the process; ``--dry-run-device cpu`` runs on fake CPU tensors instead.)

Data-dependent values. Fake tensors have no values, so token ids are zeros, losses and the
gradient norm are not computed (reported as NaN; the norm's collectives still run, clipping is
value-only), and MoE routing is the ledger's assumption: uniform (each expert gets
tokens·top_k/E rows, ``uniform_routing``). Document masks (``--doc-mask``) need the rows'
document ids: ``--doc-len N|DIR`` gives them (``dry_documents``), real tensors on the host, and
the steps that read them run outside the fake mode (``host_documents``).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import weakref
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from .. import phases
from ..comm.ops import Traffic
from ..config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ..model.moe import set_aux_grad_scale
from ..optim import lr_at
from ..parallel.context import shard_positions
from ..ranks.grid import GROUP_NAMES, DimGroup, Grid
from .memtrace import LiveTensors
from .trainer import Trainer

BACKEND = "cpu:fake,meta:fake"


# ------------------------------------------------------------------------ which ranks
def distinct_ranks(par: ParallelConfig) -> list[int]:
    """One rank of every role: first, second, middle and last pipeline stage (others at 0),
    and the rank at the last position of every other dimension (tp, cp, ep, dp) on stage 0."""
    grid = Grid.from_config(par)
    pp = par.pp
    out = {grid.rank_of(pp=c) for c in {0, 1, pp // 2, pp - 1} if 0 <= c < pp}
    out.add(grid.rank_of(pp=0, tp=par.tp - 1, cp=par.cp - 1, ep=par.ep - 1, dp=par.dp - 1))
    return sorted(out)


def parse_ranks(spec: str, par: ParallelConfig) -> list[int]:
    """``distinct`` or ``R,R,...`` (each in [0, world)); a ConfigError names the flag."""
    world = par.world_size
    if spec.strip() == "distinct":
        return distinct_ranks(par)
    try:
        ranks = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ConfigError([f"--ranks {spec!r}: give 'distinct' or rank numbers like 0,5,17"]
                          ) from None
    bad = [r for r in ranks if not 0 <= r < world]
    if not ranks or bad:
        raise ConfigError([f"--ranks {spec}: ranks must be in 0..{world - 1} (the layout "
                           f"{par.describe()} has {world} ranks); out of range: {bad}"])
    return sorted(set(ranks))


# ------------------------------------------------------------------------ documents
def dry_documents(spec: str, seq_len: int, rows: range) -> np.ndarray:
    """Document ids (len(rows), seq_len) of the windows ``rows`` (unshuffled) of a stream whose
    documents are ``spec``: N, documents of N tokens back to back; or a prepared directory, its
    training documents' lengths (the first shard's, when sharded), windows past its end
    wrapping round. An id is the document's number in the stream, as the loader gives."""
    from pathlib import Path

    try:
        n = int(float(spec))
    except ValueError:
        n = 0
    pos = np.asarray(rows, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len)
    if n:
        return pos // n
    from ..data.shards import DataDir

    data = DataDir(Path(spec))
    offsets = (data.shard_documents("train", 0) if len(data.shards("train")) > 1
               else data.documents("train"))
    pos %= max(1, (int(offsets[-1]) // seq_len) * seq_len)
    return np.searchsorted(offsets, pos, side="right").astype(np.int64) - 1


class HostChunks:
    """The ring's per-row chunk ids (``context.rank_chunks``) held on the host: indexing them
    steps out of the fake mode, so ``doc_plan`` reads real ids."""

    def __init__(self, ids: torch.Tensor):
        self.ids, self.shape = ids, ids.shape

    def __getitem__(self, key: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            return self.ids[key]


@contextlib.contextmanager
def host_documents(device: str):
    """The data-dependent steps of document masks, run on the host ids: the varlen core's
    segments (``fived.model.documents.row_segments``), the micro-batches' cut of the ids
    (``Documents.chunk``), the ring's chunk ids and chunk-pair plan (``context.rank_chunks``,
    ``context.doc_plan``: which pairs run is read from the ids, each pair's mask is then a fake
    tensor of its shape on ``device``) step out of the fake mode; everything they feed — the
    per-segment kernels, the scatter's indexes, the masked blocks — runs on the fake device as
    in a real run."""
    from ..model import documents, layers
    from ..parallel import context

    segments, chunk = layers.row_segments, documents.Documents.chunk
    plan, chunks = context.doc_plan, context.rank_chunks

    def host_chunks(docs: torch.Tensor, n: int, layout: str, balance: str) -> HostChunks:
        with unset_fake_temporarily():
            return HostChunks(chunks(docs, n, layout, balance))

    def host_plan(q_chunks: torch.Tensor, kv_chunks: torch.Tensor, c: int,
                  docs: torch.Tensor) -> list:
        with unset_fake_temporarily():
            pairs = plan(q_chunks, kv_chunks, c, docs)
        return [(rows, j, torch.empty(mask.shape, dtype=torch.bool, device=device))
                for rows, j, mask in pairs]

    def host_segments(docs: torch.Tensor) -> list:
        with unset_fake_temporarily():
            return segments(docs)

    def host_chunk(self: Any, m: int) -> list:
        with unset_fake_temporarily():
            return [documents.Documents(p, d) for p, d in
                    zip(self.positions.chunk(m), self.docs.chunk(m))]

    layers.row_segments, documents.Documents.chunk = host_segments, host_chunk
    context.doc_plan, context.rank_chunks = host_plan, host_chunks
    try:
        yield
    finally:
        layers.row_segments, documents.Documents.chunk = segments, chunk
        context.doc_plan, context.rank_chunks = plan, chunks


# ------------------------------------------------------------------------ activations
class LiveSaved:
    """Peak bytes of the distinct storages autograd holds for backward, live at once.

    A pack hook sees every tensor autograd saves; a storage is counted once (views share it)
    from the first save until the last saved reference to it is gone (``weakref.finalize``);
    parameter storages (the engine's flat buffers) are excluded."""

    def __init__(self, exclude: list[torch.Tensor]):
        self.exclude = {t.untyped_storage()._cdata for t in exclude}
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.size.pop(key)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter):
            return t
        st = t.untyped_storage()
        key = st._cdata
        if key in self.exclude:
            return t
        with unset_fake_temporarily() if not isinstance(t, FakeTensor) else \
                contextlib.nullcontext():  # the dry run's host ids (--doc-mask) are real
            t = t.view_as(t)  # our own handle: it dies when autograd drops what it saved
        if key not in self.refs:
            self.refs[key] = 0
            self.size[key] = st.nbytes()
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)
        return t

    def __enter__(self) -> LiveSaved:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


# ------------------------------------------------------------------------ attention kernel
@contextlib.contextmanager
def flash_on_meta():
    """SDPA on meta tensors -> the CUDA flash kernel's op (``aten._scaled_dot_product_flash_
    attention``, which has a meta implementation): what SDPA runs on a GPU, saving q, k, v, the
    output and the fp32 log-sum-exp — not the math fallback (materialised probabilities) SDPA
    picks for an unknown device.

    Only ``torch.nn.functional.scaled_dot_product_attention`` itself is redirected (looked up
    when called, on any thread: a recompute runs in autograd's), and only for a maskless call on
    meta tensors; the runtime's own ``fived.model.layers.causal_attention`` (and whatever else
    calls SDPA) runs unchanged, so an extra op or a saved tensor inside it is in the dry run."""
    orig = F.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             **kw: Any) -> torch.Tensor:
        if q.device.type != "meta" or attn_mask is not None or kw.get("enable_gqa"):
            return orig(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kw)
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal,
            scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


# ------------------------------------------------------------------------ MoE: uniform routing
def uniform_routing(model: torch.nn.Module) -> None:
    """Each MoE layer routes by the ledger's assumption: every expert receives tokens·top_k/E
    rows and none is dropped. The layer runs its own ``MoE.moe`` (router, aux losses and their
    count reduction, the permutation, the dispatch all-to-alls, the experts, the weighted
    un-permute) with only ``MoE.assign`` — the data-dependent index arithmetic — made static;
    the statistics (drops, aux values) are not recorded."""
    from functools import partial

    from ..ledger.params import ep_destinations_bound
    from ..model.moe import moe_layers
    from ..parallel.expert import dispatch_tokens

    for m in moe_layers(model):
        if m.dispatch is not None:  # expert parallelism: the group the real dispatch talks on
            m.dispatch = partial(_uniform_dispatch, group=m.dispatch.keywords["group"])
        if m.dispatch_tokens is not None:  # the token dispatch at the ledger's bound
            group = m.dispatch_tokens.keywords["group"]
            dests = ep_destinations_bound(m.cfg, ParallelConfig(ep=group.size))
            plan = partial(_uniform_token_plan, dests=dests, experts=m.cfg.experts)
            m.dispatch_tokens = partial(dispatch_tokens, group=group, plan=plan,
                                        received=_uniform_received)
        m.assign = _uniform_assign.__get__(m)
        m.count_stats = False


def _uniform_assign(self: Any, top_i: torch.Tensor, keep: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``MoE.assign`` at uniform routing: every assignment kept, n/E rows per expert in
    assignment order (fake tensors have no values to route by)."""
    n, E = top_i.numel(), self.cfg.experts
    if n % E:
        raise ConfigError([f"dry run: {n} token-assignments do not split evenly over {E} "
                           "experts (uniform routing)"])
    counts = torch.full((E,), n // E, dtype=torch.int64, device=top_i.device)
    return torch.arange(n, device=top_i.device), counts, [n // E] * E


def _uniform_dispatch(rows: torch.Tensor, counts: torch.Tensor, compute: Any, group: Any
                      ) -> torch.Tensor:
    """``fived.parallel.expert.dispatch`` with uniform splits: each of the n ep ranks sends
    every other rank rows/n rows (its experts' share) and receives as many."""
    from ..comm import autograd, ops

    n = group.size
    per = counts.numel() // n
    ops.all_to_all(counts.to(torch.int64).contiguous(), group)  # the counts exchange, counted
    split = [rows.shape[0] // n] * n
    got = autograd.all_to_all(rows, group, split, split)
    local_id = torch.arange(per, device=rows.device).repeat_interleave(rows.shape[0] // per)
    order = torch.argsort(local_id, stable=True)
    y = compute(got[order], [rows.shape[0] // per] * per)
    y = y[torch.argsort(order)]
    return autograd.all_to_all(y, group, split, split)


def _uniform_token_plan(tok: torch.Tensor, counts: torch.Tensor, n: int, N: int, dests: int,
                        experts: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """``fived.parallel.expert.token_plan`` at uniform routing over ``dests`` ep ranks per
    token: each rank gets N·dests/n token rows and A/n assignments (static shapes)."""
    A_ = tok.shape[0]
    if (N * dests) % n or A_ % experts:
        raise ConfigError([f"dry run: {N} tokens × {dests} ep ranks do not split evenly over "
                           f"ep {n} (uniform routing)"])
    u = N * dests // n
    u_tok = torch.arange(N * dests, device=tok.device) % N
    pos = torch.arange(A_, device=tok.device) % u
    u_counts = torch.full((n,), u, dtype=torch.int64, device=tok.device)
    return u_tok, pos, u_counts, [A_ // n] * n, [u] * n


def _uniform_received(recv: torch.Tensor, a_in: list[int], u_in: list[int]) -> list[list[int]]:
    """At uniform routing every rank receives from each source what it sends each rank: A/E
    assignments per expert and N·dests/n tokens."""
    n, per = recv.shape[0], recv.shape[1] - 1
    return [[a_in[0] // per] * per + [u_in[0]]] * n


# ------------------------------------------------------------------------ model states
STATE_KEYS = ("params", "grads", "master", "optimizer")


def _tensors(x: Any, depth: int = 2) -> list[torch.Tensor]:
    """The tensors in ``x``: itself, or inside lists, tuples and dict values ``depth`` deep."""
    if isinstance(x, torch.Tensor):
        return [x]
    if depth and isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y, depth - 1)]
    if depth and isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y, depth - 1)]
    return []


def state_tensors(engine: Any) -> dict[str, list]:
    """The tensors the engine holds between steps, under ``STATE_KEYS`` (params — the fp8
    gather's casts and scales too —, grads, master with Kahan's compensation, and whatever the
    optimizer's attributes hold); an entry may be None."""
    bks = engine.buckets
    return {"params": [engine.param_state(b) for b in bks]
            + [t for b in bks for t in engine.param_extra(b)],
            "grads": [engine.grad_state(b) for b in bks],
            "master": ([b.master for b in bks] if engine.policy.separate_master else [])
            + [b.comp for b in bks],
            "optimizer": _tensors(vars(engine.opt))}


def storage_states(engine: Any) -> dict[str, int]:
    """Model-state bytes from the storages themselves: ``untyped_storage().nbytes()`` of each
    distinct storage (views share one; it is counted once, under the first key that holds it:
    params, grads, master, optimizer). A tensor over-allocated behind a correctly sized view
    counts its whole allocation here, where ``engine.memory()`` (numel × element size) does not.
    The optimizer's tensors are whatever its attributes hold (its masters are already counted)."""
    held = state_tensors(engine)
    seen: set[int] = set()
    out = {}
    for key in STATE_KEYS:
        n = 0
        for t in held[key]:
            if t is None:
                continue
            st = t.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                n += st.nbytes()
        out[key] = n
    return out


def held_tensors(trainer: Any) -> list[torch.Tensor]:
    """What a built rank holds before its first step: the engine's states (``state_tensors``),
    the stage's parameters and buffers."""
    out = [t for ts in state_tensors(trainer.engine).values() for t in ts]
    out += list(trainer.stage.parameters()) + list(trainer.stage.buffers())
    return [t for t in out if t is not None]


def traffic_by_op(traffic: Traffic) -> dict[str, float]:
    """Bytes sent per ``group/op`` (e.g. ``tp/all_gather``), zero entries left out."""
    out: dict[str, float] = {}
    for (dim, op), r in sorted(traffic.records.items()):
        if dim in GROUP_NAMES and r.bytes:
            out[f"{dim}/{op}"] = out.get(f"{dim}/{op}", 0.0) + r.bytes
    return out


# ------------------------------------------------------------------------ one rank
class DryTrainer(Trainer):
    """The Trainer on fake tensors: zeros for data, no values read back; with ``--doc-mask``
    the rows' document ids are real, on the host (``dry_documents``)."""

    def local_data(self, step: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        b = self.grid["batch"]
        rows = self.tcfg.global_batch // b.size
        seq = self.cfg.seq_len
        if self.par.cp > 1:
            cp = self.grid["cp"]
            positions = shard_positions(seq, cp.size, cp.rank).to(self.device)
        else:
            positions = torch.arange(seq, device=self.device)
        s = positions.shape[0]
        x = torch.zeros((rows, s), dtype=torch.int64, device=self.device)
        if self.tcfg.doc_mask:  # per-row RoPE positions (fake), the rows' ids (real)
            from ..model.documents import Documents

            with unset_fake_temporarily():
                docs = torch.from_numpy(dry_documents(self.tcfg.doc_len, seq,
                                                      range(b.rank * rows, (b.rank + 1) * rows)))
            positions = Documents(torch.zeros((rows, s), dtype=torch.int64, device=self.device),
                                  docs)
        return x, torch.zeros_like(x), positions

    def dry_step(self, step: int) -> dict[str, Any]:
        self.traffic.reset()
        t0 = time.perf_counter()
        x, y, positions = self.local_data(step)
        global_tokens = self.tcfg.global_batch * self.cfg.seq_len
        if self.executor is not None:
            self.executor.measure = False  # its timing exchange reads values
            self.executor.instant_sends = True  # fake sends never report completion
        exclude = list(self.stage.parameters()) + [b.param_full for b in self.engine.buckets]
        self.engine.zero_grad()
        set_aux_grad_scale(self.stage, 1.0 / global_tokens)
        with LiveSaved(exclude) as saved:
            self.forward_backward(x, y, positions, 1.0 / global_tokens)
        phases.enter("reduce")
        self.engine.finish()
        phases.enter("clip")
        self.engine.unscale()
        self.engine.grad_sq()  # the clip's collectives; the norm itself is a value
        lr = lr_at(step, self.tcfg.steps, self.tcfg.lr, self.tcfg.warmup, self.tcfg.min_lr_ratio)
        phases.enter("optimizer")
        self.engine.step(lr)
        if self.balancer:  # balance = bias: the routed counts' all-reduce (zeros here)
            self.balancer.sync(True)
        phases.enter("end")
        return {"step": step, "loss": float("nan"), "tokens": global_tokens,
                "seconds": time.perf_counter() - t0, "lr": lr, "grad_norm": float("nan"),
                "skipped": False, "activation_peak": saved.peak}


def connect_local(par: ParallelConfig, rank: int, traffic: Traffic) -> Grid:
    """This rank's groups only (``use_local_synchronization``): the fake world needs no others."""
    grid = Grid.from_config(par, rank)
    world = par.world_size
    for name in GROUP_NAMES:
        mine = grid.members(Grid.named_dims(name))
        if len(mine) == 1:
            pg = None
        elif len(mine) == world:
            pg = dist.group.WORLD
        else:
            pg = dist.new_group(list(mine), use_local_synchronization=True)
        grid.groups[name] = DimGroup(name, mine, mine.index(rank), pg, traffic)
    return grid


def dry_run_rank(model_cfg: ModelConfig, par: ParallelConfig, train: TrainConfig, rank: int,
                 device: str = "meta") -> dict[str, Any]:
    """One rank's record: model-state bytes, traffic by group, activation peak, seconds."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = par.world_size
    t0 = time.perf_counter()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world)
    try:
        traffic = Traffic()
        grid = connect_local(par, rank, traffic)
        docs = host_documents(device) if train.doc_mask else contextlib.nullcontext()
        with FakeTensorMode(), flash_on_meta(), docs:
            trainer = DryTrainer(model_cfg, par, train, rank, world, grid=grid, device=device,
                                 init=False)
            if model_cfg.is_moe:
                uniform_routing(trainer.stage)
            t_build = time.perf_counter() - t0
            trace = LiveTensors()
            trace.seed(held_tensors(trainer))
            with trace:
                rec = trainer.dry_step(0)
            mem = trainer.engine.memory()
            storage = storage_states(trainer.engine)
        rec["peak"], rec["peak_phase"] = trace.step_peak()
        rec["phases"] = trace.by_phase()
        rec["memory"] = {k: int(mem.get(k, 0)) for k in
                         ("params", "grads", "master", "optimizer", "buffers", "padding")}
        rec["memory_storage"] = storage
        rec["traffic"] = {k: v for k, v in traffic.bytes_by_dim().items()
                          if k in GROUP_NAMES and v}
        rec["traffic_ops"] = traffic_by_op(traffic)
        rec["build_seconds"] = t_build
        rec["rank"] = rank
        rec["coords"] = grid.coords()
        return rec
    finally:
        quiet_destroy()


def quiet_destroy() -> None:
    """``destroy_process_group`` without torch's C++ warning "No backend of type 0 found ...
    Assuming no hooks are registered": torch sets a multi-backend group's default backend only
    when a plugin's registered name equals the map's value ("FAKE" against "fake"), so its
    ``_has_hooks`` check at teardown warns on every rank. The fake backend registers no hooks;
    naming it the default (CUSTOM) is what torch would have done."""
    pg = dist.group.WORLD
    if pg is not None and hasattr(pg, "_set_default_backend"):
        try:
            pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        except RuntimeError:  # not a backend of this group: leave torch's own path
            pass
    dist.destroy_process_group()


def dry_run(model_cfg: ModelConfig, par: ParallelConfig, train: TrainConfig, ranks: list[int],
            device: str = "meta", out_path: str = "", show: bool = True) -> dict[str, Any]:
    """Dry-run ``ranks`` one after the other; one JSONL record (``--metrics-out``)."""
    recs = []
    for i, r in enumerate(ranks):
        t = time.perf_counter()
        rec = dry_run_rank(model_cfg, par, train, r, device)
        rec["wall_seconds"] = time.perf_counter() - t
        recs.append(rec)
        if show:
            c = rec["coords"]
            where = " ".join(f"{d}{c[d]}" for d in ("pp", "dp", "ep", "cp", "tp")
                             if par.degree(d) > 1)
            print(f"  rank {r:>6} ({where}): states {sum(rec['memory'].values()) / 2**30:8.2f} "
                  f"GiB · activations {rec['activation_peak'] / 2**30:8.2f} GiB · "
                  f"{rec['wall_seconds']:.1f} s  [{i + 1}/{len(ranks)}]", flush=True)
    out = {"step": 0, "loss": float("nan"), "tokens": train.global_batch * model_cfg.seq_len,
           "dry_run": {"device": device, "backend": BACKEND,
                       "assumptions": "token ids 0; loss and grad norm not computed (NaN); "
                                      "MoE routing uniform"
                                      + (f"; documents --doc-len {train.doc_len}"
                                         if train.doc_mask else "")},
           "ranks": ranks,
           "memory": recs[0]["memory"],
           "memory_per_rank": [r["memory"] for r in recs],
           "traffic": recs[0]["traffic"],
           "traffic_per_rank": [{"bytes": r["traffic"], "ops": r["traffic_ops"]} for r in recs],
           "memory_storage_per_rank": [r["memory_storage"] for r in recs],
           "activation_peak_per_rank": [r["activation_peak"] for r in recs],
           "peak_per_rank": [r["peak"] for r in recs],
           "peak_phase_per_rank": [r["peak_phase"] for r in recs],
           "phases_per_rank": [r["phases"] for r in recs],
           "seconds_per_rank": [r["wall_seconds"] for r in recs],
           "run": {"model": asdict(model_cfg), "parallel": asdict(par),
                   "global_batch": train.global_batch, "doc_mask": train.doc_mask}}
    if out_path:
        with open(out_path, "w") as f:
            f.write(json.dumps(out) + "\n")
    return out
