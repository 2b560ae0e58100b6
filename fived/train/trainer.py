"""The training loop: one optimizer step = the global batch, whatever the layout.

Per step every rank
1. takes its slice of the global batch (batch group dp·ep) and, with cp, its sequence shard;
2. runs the micro-batches (through the pipeline executor when pp > 1), each backward of
   Σ CE(local tokens) / global_tokens — so gradients summed over the data-parallel groups equal
   the one-rank gradient exactly;
3. reduces gradients (the engine: DDP or ZeRO), clips by the global norm and steps AdamW;
4. reports loss, tokens, seconds, model-state bytes and bytes sent per dimension.

The data is the built-in corpus (``fived.train.data``) or, with ``--data DIR``, the prefetching
loader of ``fived.data.loader`` (rows of the batch group only; the padded vocabulary masked);
``evaluate`` gives the validation loss (forward only, docs/eval.md), ``data_state`` /
``load_data_state`` the data position a checkpoint stores (docs/data.md).

``train_rank`` is what each rank runs (under ``torchrun`` or spawned by ``fived.ranks.launch``);
``eval_rank`` what each rank of ``fived eval`` runs.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist

from .. import phases
from ..comm import ops
from ..comm.ops import Traffic
from ..config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ..data.vocab import ignore_marked_targets, mask_padded_logits, tally_sources
from ..ledger.context import positions as cp_positions
from ..model import build_model
from ..model.documents import micro_positions
from ..model.init import InitSource
from ..model.moe import moe_layers
from ..model.mtp import mtp_blocks
from ..optim import lr_at
from ..parallel.balance import RouteBalancer, RoutingStatistics
from ..parallel.parallelize import dtype_of, parallelize
from ..ranks.grid import GROUP_NAMES, DimGroup, Grid
from ..ranks.launch import rank_device
from . import data as builtin_data
from .metrics import rss_peak
from .resilience import non_finite

MEMORY_KEYS = ("params", "grads", "master", "optimizer", "buffers", "padding")
TRAFFIC_KEYS = GROUP_NAMES


class Trainer:
    """One rank's training: the plain model, laid out by ``parallelize``, and the step loop."""

    def __init__(self, model_cfg: ModelConfig, par: ParallelConfig, train: TrainConfig,
                 rank: int, world: int, grid: Grid | None = None,
                 device: torch.device | str | None = None, init: bool = True,
                 eval_split: str = ""):
        """``grid``: an already connected grid (the dry run's); ``device``: where every tensor
        of this rank lives (default: ``rank_device()``, cuda under nccl); ``init=False`` skips
        drawing the weights (fake tensors in the dry run); ``eval_split`` (``fived eval``):
        open only the loader of this split of --data, for ``evaluate``, no training loader."""
        self.cfg, self.tcfg = model_cfg, train
        self.par = par
        self.rank, self.world = rank, world
        self.device = torch.device(device) if device is not None else rank_device()
        # --data, layout-free (a bad directory fails before the build); the rows come below
        self.loader, self.eval_loader, self.source_eval = builtin_data.open_loaders(
            train, model_cfg, eval_split)
        self.traffic = grid.groups["tp"].traffic if grid is not None else Traffic()
        self.grid = grid if grid is not None else Grid.from_config(par, rank).connect(self.traffic)
        self.coords = self.grid.coords()
        # born sharded: the plain model on meta (no storage), cut on meta by ``parallelize``;
        # the engine then allocates this rank's flat buffers on its device and ``source``
        # fills each piece (drawn from (seed, name) block by block, or read as a slice of the
        # Hugging Face files); resume overwrites them from the checkpoint's slices
        self.trace = None  # --memory-trace: every storage's life, from the build on
        if train.memory_trace:
            from .memtrace import LiveTensors

            self.trace = LiveTensors().__enter__()
        t0 = time.perf_counter()  # the build (after the grid is connected)
        model = build_model(model_cfg, train.seed, dtype_of(par.precision), "meta", init=False)
        source = None
        if init and train.init_from:
            from ..checkpoint.hf import HFSource

            source = HFSource(train.init_from, model_cfg)
        elif init:
            source = InitSource(train.seed, model.param_std)
        if train.compile:  # torch.compile each block (the GPU path's option), MTP's too
            for blk in [*model.layers.values(), *mtp_blocks(model)]:
                blk.compile()
        self.parallel = parallelize(model, self.grid, par, train, source, self.device)
        self.world_metrics = DimGroup("metrics", tuple(range(world)), rank,
                                      dist.group.WORLD if world > 1 else None, self.traffic)
        # the step's hooks: before it, a MoE model's aux-loss gradient scale; after the optimizer
        # step, balance = bias's route balancer (its counts' all-reduce and the update; it makes
        # each bias as zeros on the device, resume loads them); then the record's MoE statistics
        # (collected, and reset, after the balancer read them)
        routing = RoutingStatistics(self.parallel.model, model_cfg, par, self.parallel.placements,
                                    self.world_metrics, self.traffic)
        self.balancer = RouteBalancer(self.parallel.model, self.grid["batch"], self.device,
                                      model_cfg.bias_update_rate, source)
        self.pre_step = [routing.before_step] if model_cfg.is_moe else []
        self.post_step = [self.balancer.after_step] if self.balancer else []
        self.on_record = [routing.record] if model_cfg.is_moe else []
        # the loss's all-reduces, charged to metrics: over dense, tp, then pp (dense × tp × pp
        # is the world; only the last pipeline stage holds a loss)
        self.loss_groups = [replace(self.grid[name], name="metrics")
                            for name in ("dense", "tp", "pp")]
        # a dense model's Σ g² under ZeRO (flat grid) is summed over the ZeRO shards (dense),
        # then tp and pp: the loss's groups, in its order, so it rides in the loss all-reduce
        # (one collective a step fewer; the same sums, bit for bit: gloo adds each element of a
        # small vector in one order whatever its position)
        self.norm_rides_loss = (not model_cfg.is_moe and self.parallel.engine.stage >= 1
                                and self.grid.shard_group("dense") == "dense")
        for moe in moe_layers(self.parallel.model):  # its statistics were made on meta
            moe.reset_stats()
        self.build_rss = rss_peak()  # the build's peak (VmHWM): this rank's pieces, no more
        self.build_seconds = time.perf_counter() - t0
        self.build_cuda = (torch.cuda.max_memory_allocated(self.device)
                           if self.device.type == "cuda" else 0)  # the build's device peak
        self.stage = self.parallel.model
        self.engine = self.parallel.engine
        self.executor = self.parallel.executor
        self.next_step = 0  # the data position: the step the next batch belongs to
        cp = self.grid["cp"]  # this rank's columns: the cp shard (fived.train.data.shard)
        self.cut = dict(cp=cp, balance=train.cp_balance, doc_positions=train.doc_positions,
                        device=self.device, zigzag=(
                            torch.tensor(cp_positions(model_cfg.seq_len, cp.size, cp.rank))
                            if par.cp > 1 else None))
        if train.data:  # the rows: this rank's of the batch group; the padded logits masked
            b = self.grid["batch"]
            for ld in (self.loader, self.eval_loader, *self.source_eval.values()):
                if ld is not None:
                    ld.place(b.rank, b.size, self.device)
            mix = self.loader if self.loader is not None else self.eval_loader
            masked = mask_padded_logits(self.stage, mix.data.vocab, model_cfg.vocab)
            if (mix.data.vocab < model_cfg.vocab and getattr(self.stage, "last", True)
                    and not masked):
                raise RuntimeError("the padded vocabulary rows could not be masked: no loss "
                                   "module")
            if train.eos_target == "ignore":  # the EOS tokens' targets marked in shard,
                # skipped by the loss (inside the mixture's per-source split, made next)
                ignore_marked_targets(self.stage)
                self.cut["eos_id"] = mix.data.eos
            if hasattr(mix, "sources"):  # a mixture: the loss per source (each step's too)
                tallies = tally_sources(self.stage, len(mix.sources))
                if mix is self.loader:
                    by_source = builtin_data.SourceLosses(mix, tallies, self.loss_groups,
                                                          par.tp, model_cfg.seq_len,
                                                          self.device)
                    self.pre_step.append(by_source.before_step)
                    self.on_record.insert(0, by_source.record)

    # -------------------------------------------------------------------- data position
    def data_state(self) -> dict[str, Any]:
        """What a checkpoint stores of the data: its identity and the next step (the loader
        is a pure function of (seed, step, data), so the step is the whole position)."""
        if self.loader is not None:
            return self.loader.state(self.next_step)
        return {"source": "builtin", "corpus_mb": self.tcfg.corpus_mb, "seed": self.tcfg.seed,
                "global_batch": self.tcfg.global_batch, "seq_len": self.cfg.seq_len,
                "next_step": self.next_step}

    def load_data_state(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``data_state``; a ConfigError if it read other data. An
        imported checkpoint (``fived import``: weights only, no data yet) starts at step 0."""
        if not saved:
            self.next_step = 0
            return
        mine = self.data_state()
        flags = {"source": "--data", "tokenizer_hash": "--data (its tokenizer)",
                 "data_hash": "--data (its tokens)", "corpus_mb": "--corpus-mb",
                 "seed": "--seed", "global_batch": "--global-batch", "seq_len": "--seq-len"}
        bad = [f"{flag}: the checkpoint's {k} is {saved.get(k)!r}, this run's is "
               f"{mine.get(k)!r}" for k, flag in flags.items()
               if (k in ("source", "tokenizer_hash") or (k in mine and k in saved))
               and saved.get(k) != mine.get(k)]
        if bad:
            raise ConfigError([f"the checkpoint was trained on other data: {b}" for b in bad]
                              + ["resume with the data (and --seed, --global-batch) the "
                                 "checkpoint was trained on"])
        self.next_step = int(saved.get("next_step", 0))

    # -------------------------------------------------------------------- one step
    def local_data(self, step: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """This rank's rows of step ``step``'s batch, its columns of them (``shard``) and their
        positions, on its device."""
        if self.loader is not None:
            x, y, *docs = self.loader.get(step)
        else:
            b = self.grid["batch"]
            x, y = builtin_data.local_batch(step, self.tcfg.seed, self.tcfg.global_batch,
                                            self.cfg.seq_len, b.rank, b.size,
                                            self.tcfg.corpus_mb)
            docs = []
        return builtin_data.shard(x, y, *docs, **self.cut)

    def shard(self, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """This rank's part of its batch rows (``fived.train.data.shard``): the cp sequence
        shard and its positions (a ``Documents`` with document ids, --doc-mask)."""
        return builtin_data.shard(x, y, docs, **self.cut)

    def forward_backward(self, x, y, positions, scale: float) -> torch.Tensor:
        """All micro-batches of this step; returns this rank's summed token loss (detached)."""
        if self.executor is not None:
            return self.executor.run(x, y, positions, scale, self.engine)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        m = self.par.micro_batches
        ps = micro_positions(positions, m)
        for k, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
            self.engine.set_last_micro(k == m - 1)
            phases.compute("F", k, 0)
            loss = self.stage(xm, ps[k], ym)
            phases.compute("B", k, 0)
            (loss * scale).backward()
            total += loss.detach().float()
        return total

    def step(self, step: int, on_grads: Any = None, preempt: Any = None) -> dict[str, Any]:
        """One optimizer step; ``on_grads()`` (tests) runs once the gradients are reduced;
        ``preempt`` (``resilience.Preemption``): its vote rides on the loss all-reduce."""
        if self.trace is not None:
            self.trace.restart()
        self.traffic.reset()
        t0 = time.perf_counter()
        waited = self.loader.wait_s if self.loader is not None else 0.0
        with self.trace.untracked() if self.trace is not None else contextlib.nullcontext():
            x, y, positions = self.local_data(step)
        self.next_step = step + 1
        global_tokens = self.tcfg.global_batch * self.cfg.seq_len
        self.engine.zero_grad()
        scaler = getattr(self.engine, "scaler", None)  # fp16: the aux losses are scaled too
        for hook in self.pre_step:  # MoE: d(step loss)/d(local aux sum); a mixture's tallies
            hook((scaler.scale if scaler else 1.0) / global_tokens)
        mtp = getattr(self.stage, "mtp", None)  # multi-token prediction: its modules' tallies
        if mtp is not None:
            mtp.reset()
        local_loss = self.forward_backward(x, y, positions, 1.0 / global_tokens)
        phases.enter("reduce")
        self.engine.finish()
        if on_grads is not None:
            on_grads()
        phases.enter("clip")
        # the loss before the update: both it and the norm are global, so every rank sees the
        # same bad step (fived.train.resilience) and skips it (the engine's overflow skip
        # covers a non-finite norm; a non-finite loss alone is skipped here)
        if self.norm_rides_loss:  # the owned Σ g² summed by the loss's all-reduces
            self.engine.unscale()
            *losses, total_sq = self.global_losses(self.step_losses(local_loss, mtp), preempt,
                                                   self.engine.owned_sq()["dense"])
            grad_norm = self.engine.clip(self.tcfg.grad_clip, torch.tensor(total_sq,
                                                                           dtype=torch.float64))
        else:
            grad_norm = self.engine.clip(self.tcfg.grad_clip)
            losses = self.global_losses(self.step_losses(local_loss, mtp), preempt)
        lr = lr_at(step, self.tcfg.steps, self.tcfg.lr, self.tcfg.warmup, self.tcfg.min_lr_ratio)
        loss = losses[0] / global_tokens
        bad = non_finite(loss, grad_norm, self.par.precision == "fp16")
        phases.enter("optimizer")
        stepped = (self.engine.step(lr) if math.isfinite(loss)
                   or getattr(self.engine, "overflow", False) else False)
        phases.enter("end")
        if self.engine.skip_reason and self.rank == 0:
            print(self.engine.skip_reason, flush=True)
        after = [hook(stepped) for hook in self.post_step]
        seconds = time.perf_counter() - t0
        rec = {"step": step, "loss": loss, "tokens": global_tokens, "seconds": seconds,
               "lr": lr, "grad_norm": grad_norm, "skipped": not stepped, "bad": bad}
        if self.cfg.mtp_depth:  # each module's loss, over the same tokens as the trunk's
            rec["mtp_losses"] = [v / global_tokens for v in losses[1:]]
        if self.loader is not None:  # seconds this step waited for the prefetch thread
            rec["data_wait_s"] = self.loader.wait_s - waited
        for record in self.on_record:  # a mixture's loss per source; MoE: tokens per expert,
            # dropped, aux losses, a2a share
            record(rec, seconds)
        for extra in after:  # the balancer's: this rank's layers' global counts and biases
            rec["moe"].update(extra)
        if self.trace is not None:
            rec["trace_peak"], rec["trace_phase"] = self.trace.step_peak()
            rec["trace_phases"] = self.trace.by_phase()[1:]
        return rec

    def forward_only(self, x, y, positions) -> torch.Tensor:
        """All micro-batches forward only (call under ``torch.no_grad``): this rank's summed
        token loss; through the executor's forward-only schedule when pp > 1."""
        if self.executor is not None:
            return self.executor.run_forward(x, y, positions, self.engine)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        m = self.par.micro_batches
        for xm, ym, pm in zip(x.chunk(m), y.chunk(m), micro_positions(positions, m)):
            total += self.stage(xm, pm, ym).float()
        return total

    def evaluate(self, batches: int = 0, on_batch: Any = None) -> dict[str, float]:
        """Validation loss (mean CE per token) and perplexity over ``batches`` (default
        --eval-batches) global batches of the evaluation split, the same sequences on every
        layout. Forward only, under ``torch.no_grad``: no graph, no backward, no gradient
        buffer touched or reduced (ZeRO-3 gathers each unit for its forward and frees it);
        the MoE routing statistics are left as the training steps made them.
        ``on_batch(k, loss_k)`` (``fived eval``'s progress) gets each batch's global loss
        (one extra metrics all-reduce per batch)."""
        assert self.eval_loader is not None
        n = batches or self.tcfg.eval_batches
        tokens = self.tcfg.global_batch * self.cfg.seq_len
        stats = [(m, m.stats.snapshot()) for m in moe_layers(self.stage)]
        out: dict[str, Any] = {}
        try:
            with torch.no_grad():
                loaders = [("", self.eval_loader, on_batch),
                           *((name, ld, None) for name, ld in self.source_eval.items())]
                for name, loader, progress in loaders:
                    total = None  # on whatever device the step's loss is
                    for k in range(n):
                        x, y, positions = self.shard(*loader.get(k))
                        loss = self.forward_only(x, y, positions)
                        total = loss if total is None else total + loss
                        if progress is not None:
                            progress(k, self.global_loss(loss) / tokens)
                    loss = self.global_loss(total) / (n * tokens)
                    if name:  # a mixture's source, alone (its own validation windows)
                        out.setdefault("val_loss_by_source", {})[name] = loss
                    else:
                        out.update(val_loss=loss, val_ppl=math.exp(min(loss, 700.0)))
        finally:
            self.engine.end_forward()
            for m, saved in stats:  # MoE routing statistics belong to training steps
                m.stats = saved
        return out

    def close(self) -> None:
        for ld in (self.loader, self.eval_loader, *self.source_eval.values()):
            if ld is not None:
                ld.close()
        self.engine.close()
        if self.trace is not None:
            self.trace.__exit__(None, None, None)
            self.trace = None

    def step_losses(self, local: torch.Tensor, mtp: Any) -> torch.Tensor:
        """This rank's summed losses: the objective's alone, or with multi-token prediction
        [the trunk's, module 1's, ..., module D's] (the trunk's is the objective less
        λ/D·Σ modules'; zeros on a pipeline rank without the last stage)."""
        d = self.cfg.mtp_depth
        if not d:
            return local.double().reshape(1)
        each = (mtp.tally.to(local.device) if mtp is not None
                else torch.zeros(d, dtype=torch.float64, device=local.device))
        trunk = local.double().reshape(1) - self.cfg.mtp_loss_weight / d * each.sum()
        return torch.cat([trunk, each])

    def global_loss(self, local: torch.Tensor, preempt: Any = None) -> float:
        """Σ token losses over the world: each token's loss is counted on one tp rank's copy.
        dense × tp × pp is the world, so an active ``preempt``'s vote, an element after the
        losses, is summed over every rank and handed back (``preempt.count``): the preemption
        agreement costs no collective of its own (fived.train.resilience)."""
        return self.global_losses(local.double().reshape(1), preempt)[0]

    def global_losses(self, local: torch.Tensor, preempt: Any = None,
                      carry: torch.Tensor | None = None) -> list[float]:
        """``global_loss`` of each element of ``local`` (one all-reduce per group for all);
        ``carry`` (a float64 scalar summed over the same groups as it is) is the last element."""
        t = local.double().reshape(-1) / self.grid.degrees["tp"]
        if carry is not None:
            t = torch.cat([t, carry.reshape(1)])
        n = t.numel()
        if preempt is not None and preempt.active:
            t = torch.cat([t, t.new_tensor([preempt.vote()])])
        for group in self.loss_groups:
            ops.all_reduce(t, group)
        if t.numel() > n:
            preempt.count(float(t[n]))
        return [float(v) for v in t[:n]]

    def gather_stats(self, mem: dict[str, int]) -> tuple[list[dict], list[dict]] | None:
        """Every rank's memory and traffic, on rank 0 (one gather, a metrics-only collective;
        the other ranks get None and take rank 0's records at the end:
        ``MetricsProcessor.final``)."""
        by_dim = self.traffic.bytes_by_dim()
        secs = self.traffic.seconds_by_dim()
        row = [float(mem.get(k, 0)) for k in MEMORY_KEYS]
        row += [float(by_dim.get(k, 0.0)) for k in TRAFFIC_KEYS]
        row += [float(secs.get(k, 0.0)) for k in TRAFFIC_KEYS]
        row += [float(self.trace.step_peak()[0] if self.trace is not None else 0)]
        row += [float(self.build_rss), float(rss_peak()), self.build_seconds]
        vec = torch.tensor(row, dtype=torch.float64, device=self.device)
        got = ops.gather(vec, self.world_metrics, dst=0)
        if got is None:
            return None
        rows = [r.tolist() for r in got]
        nm, nt = len(MEMORY_KEYS), len(TRAFFIC_KEYS)
        mems = [dict(zip(MEMORY_KEYS, map(int, r[:nm]))) for r in rows]
        traffic = [
            {"bytes": {k: v for k, v in zip(TRAFFIC_KEYS, r[nm:nm + nt]) if v},
             "seconds": {k: v for k, v in zip(TRAFFIC_KEYS, r[nm + nt:-4]) if v}}
            for r in rows
        ]
        self.traced = [int(r[-4]) for r in rows]  # --memory-trace: each rank's step peak
        # peak resident bytes per rank: after the build, and so far (the run's peak)
        self.rss = [{"build": int(r[-3]), "peak": int(r[-2]), "build_s": r[-1]} for r in rows]
        return mems, traffic


def train_rank(rank: int, world: int, model_cfg: ModelConfig, par: ParallelConfig,
               train: TrainConfig, show: bool = True, peak_flops: float = 0.0,
               hooks: list[Any] | tuple[Any, ...] = ()) -> dict[str, Any]:
    """Train on this rank: the loop over its parts (``CheckpointManager``, ``MetricsProcessor``,
    ``Evaluator``, ``BadSteps``; ``hooks``: ``fived.train.hooks``). Every rank returns the same
    summary (``run_summary``)."""
    from ..checkpoint.state import SaveError
    from .checkpointing import CheckpointManager
    from .evaluator import Evaluator
    from .hooks import Hooks
    from .metrics import MetricsProcessor
    from .resilience import BadSteps, History, Preemption

    torch.manual_seed(train.seed)
    # what rank 0 is doing between `fived train`'s first line and step 1, as it starts each part
    say = (lambda text: print(text, flush=True)) if show and rank == 0 else (lambda text: None)
    say(f"{world} rank(s) up; building {model_cfg.name} and its layout on each ...")
    t0 = time.perf_counter()
    # caught from here on: a signal while the model is built or loaded acts after step one
    preempt = Preemption(train.preempt_signals)
    try:
        trainer = Trainer(model_cfg, par, train, rank, world)
    except BaseException:
        preempt.close()
        raise
    say(f"built in {time.perf_counter() - t0:.1f} s"
        + (f"; loading {train.resume} ..." if train.resume else ""))
    ckpt, run_hooks = CheckpointManager(trainer, train, show), Hooks(hooks)
    start = ckpt.resume()
    metrics = MetricsProcessor(trainer, train, show, peak_flops, start)
    evaluator, bad, history = Evaluator(trainer, train), BadSteps(train.max_bad_steps), History()
    end, stopped = min(train.steps, train.stop_after or train.steps), ""
    try:
        for step in range(start, end):
            run_hooks.step_start(trainer, step)
            rec = trainer.step(step, run_hooks.grads(trainer, step), preempt)
            mems = metrics.measure(rec)
            evaluator.after_step(rec, step, metrics)
            bad.update(rec, rank)
            history.add(rec)
            metrics.log(rec, step, end)
            if bad.stop:  # nothing more is saved: the newest checkpoint is the last good one
                if rank == 0:
                    print(f"fived train: {bad.stop}", flush=True)
                break
            if ckpt.after_step(step, end, mems, bad.run, preempt):
                break
        ckpt.wait()
    except SaveError as e:  # every rank together; the previous checkpoint is intact
        stopped = str(e)
        if rank == 0:
            print(f"fived train: {stopped}", flush=True)
    finally:
        preempt.close()
        trainer.close()
        metrics.close()
    metrics.final(history)
    return run_summary(trainer, history, bad.total, ckpt.preempted, bad.stop or stopped)


def run_summary(trainer: Trainer, history: Any, bad_steps: int, preempted: int | None,
                stopped: str) -> dict[str, Any]:
    """What ``train_rank`` returns: the losses, the kept records, the configuration; why a run
    ended early: ``preempted`` (steps done, saved) or ``stopped`` (too many bad steps, a failed
    save; fived.train.resilience); ``val``: the validation losses by step."""
    summary = {"losses": history.losses.tolist(), "history": list(history.records),
               "bad_steps": bad_steps, "config": {"model": asdict(trainer.cfg),
                                                  "parallel": asdict(trainer.par),
                                                  "train": asdict(trainer.tcfg)}}
    if preempted is not None:
        summary["preempted"] = preempted
    if stopped:
        summary["stopped"] = stopped
    if history.evals:
        summary["val"] = history.evals
    return summary


def eval_rank(rank: int, world: int, model_cfg: ModelConfig, par: ParallelConfig,
              train: TrainConfig, ckpt: str, split: str, batches: int,
              progress: str = "stdout") -> dict[str, Any]:
    """``fived eval`` on this rank: the weights of checkpoint ``ckpt`` (any layout) laid out
    as ``par``, then ``batches`` global batches of ``split`` of ``train.data`` forward only.
    Every rank returns the same summary; rank 0 prints a progress line per batch to
    ``progress`` ("stdout", "stderr" or "" for none)."""
    import sys

    from ..checkpoint import load

    torch.manual_seed(train.seed)
    trainer = Trainer(model_cfg, par, train, rank, world, eval_split=split)
    try:
        step = load(trainer, ckpt, weights_only=True)
        out = sys.stdout if progress == "stdout" else sys.stderr
        t0 = time.perf_counter()

        def on_batch(k: int, loss: float) -> None:
            if rank == 0 and progress:
                print(f"batch {k + 1}/{batches}: loss {loss:.4f}, perplexity "
                      f"{math.exp(min(loss, 700.0)):.2f} ({time.perf_counter() - t0:.2f} s)",
                      file=out, flush=True)

        res = trainer.evaluate(batches, on_batch)
        seconds = time.perf_counter() - t0
    finally:
        trainer.close()
    tokens = batches * train.global_batch * model_cfg.seq_len
    return {"loss": res["val_loss"], "ppl": res["val_ppl"], "tokens": tokens,
            **({"loss_by_source": res["val_loss_by_source"]}
               if "val_loss_by_source" in res else {}),
            "seconds": seconds, "tokens_per_s": tokens / seconds, "step": step}
