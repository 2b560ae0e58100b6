"""What ``fived ledger`` reports about one layout, as data: ``ledger_document`` (every number
the command prints, JSON-able) and ``advice`` (what was assumed, what to change, the ``fived
plan`` command that finds a layout). The command prints them; ``fived report``'s one-layout page
draws them — both read the same sentences."""

from __future__ import annotations

import argparse

from ..config import ModelConfig, ParallelConfig
from . import flags
from .report import fmt_b, fmt_n

BUBBLE_LIMIT = 0.25  # a bubble above this share of the step is worth a sentence


def advice(doc: dict, args: argparse.Namespace, res: flags.Resolved, par: ParallelConfig,
           world: int, gb: int, batch_note: str, auto_m: bool) -> dict:
    """What the ledger assumed (the values no flag gave) and, where the layout does not fit
    or its bubble is over ``BUBBLE_LIMIT``, what to change and the `fived plan` command that
    searches for a layout: ``{"assumed": [...], "change": [...], "plan": "..."}``."""
    m = res.model
    given = res.given
    assumed: list[str] = []
    if args.gpus is not None and not res.dp_given and par.dp > 1:
        assumed.append(f"dp {par.dp}: the GPUs left of --gpus {world} by tp·cp·ep·pp = "
                       f"{par.tp * par.cp * par.ep * par.pp} (no --dp)")
    if batch_note:
        assumed.append(f"global batch {gb} sequences = {fmt_n(gb * m.seq_len)} tokens"
                       f"{batch_note}")
    if auto_m and par.micro_batches > 1:
        assumed.append(f"{par.micro_batches} micro-batches of "
                       f"{gb // (par.dp * par.ep * par.micro_batches)} sequence(s) per replica "
                       "(no --micro-batches: one sequence each, the rest accumulated)")
    if args.gpus is not None and not any(f"parallel.{d}" in given for d in
                                         ("tp", "cp", "ep", "pp", "zero", "recompute")):
        assumed.append("no --tp, --pp, --cp, --ep, --zero or --recompute: plain data "
                       "parallelism, every rank holds the whole model")
    change: list[str] = []
    mem, usable = doc["memory"], doc["usable_memory"]
    if not doc["fits"]:
        change.append(f"it does not fit: the largest rank's step peaks at "
                      f"{fmt_b(mem['peak'] or mem['total'])} of {fmt_b(usable)} usable")
        if mem["states_total"] > usable / 2:
            shard = ("--zero 3 shards them over dp" if par.zero < 3 and par.dp * par.ep > 1
                     else "")
            split = "--tp (within a node) and --pp split the model"
            change.append(f"model states are {fmt_b(mem['states_total'])}: "
                          + (f"{shard}; {split}" if shard else split))
        if mem["activations_total"] > usable / 4:
            rc = {"none": "--recompute selective or full", "selective": "--recompute full"}.get(
                par.recompute, "")
            more = [x for x in (rc, "--sequence-parallel with --tp" if par.tp > 1 and not
                                par.sequence_parallel else "",
                                "--cp for long sequences" if par.cp == 1 else "",
                                "fewer sequences per micro-batch (--micro-batches)"
                                if doc["micro_batch_size"] > 1 else "") if x]
            if more:
                change.append(f"activations are {fmt_b(mem['activations_total'])}: "
                              + ", ".join(more))
    bubble = doc["time"]["bubble_fraction"]
    if par.pp > 1 and bubble > BUBBLE_LIMIT:
        change.append(f"the pipeline bubble is {bubble:.0%} of the step (pp {par.pp}, "
                      f"m = {par.micro_batches} micro-batches): --micro-batches of 4·pp = "
                      f"{4 * par.pp} or more (with a --global-batch to match), or "
                      "--schedule interleaved --virtual-stages 2")
    plan = ""
    if change or (assumed and args.gpus is not None):
        plan = (f"fived plan --model {m.name} --gpus {world} --gpu {args.gpu}"
                + (f" --gpus-per-node {args.gpus_per_node}" if args.gpus_per_node else "")
                + (f" --seq-len {m.seq_len}" if "model.seq_len" in given else "")
                + f" --global-batch {gb}")
    return {"assumed": assumed, "change": change, "plan": plan}


def ledger_document(m: ModelConfig, par: ParallelConfig, hw, global_batch: int,
                    gpn: int, efficiency: float | None, mem_fraction: float,
                    opts, train_tokens: float, optimizer: str = "adamw", clock=None) -> dict:
    """Everything ``fived ledger`` prints, as one JSON-able dict."""
    from ..ledger import bubble as bubble_formulas
    from ..ledger import compute, params, planner
    from ..ledger import memory as memory_ledger
    from ..ledger.traffic import micro_batch_size

    n = params.total_params(m)
    counts = params.param_counts(m)
    b = micro_batch_size(par, global_batch)
    pr = planner.predict(m, par, hw, global_batch, gpn, efficiency, mem_fraction, opts, optimizer,
                    clock)
    ranks = params.all_rank_params(m, par)
    fwd = compute.forward_flops_per_token(m)
    attn = compute.attention_flops_per_token(m)
    tokens = global_batch * m.seq_len
    mf = compute.model_flops_per_token(m)
    wall = compute.training_flops(n, train_tokens)
    return {
        "model": {"name": m.name, "params": n, "dense": counts["dense"], "expert": counts["expert"],
                  "active": params.active_params(m), "by_kind": counts,
                  "checkpoint_bf16_bytes": memory_ledger.checkpoint_bytes(m, 2),
                  "training_state_16psi_bytes": 16 * n,
                  "layout_bytes_per_param": memory_ledger.bytes_per_param(par),
                  "layout_training_state_bytes": memory_ledger.bytes_per_param(par) * n,
                  "device_memory": hw.memory,
                  "training_state_fits_one_device": 16 * n <= hw.memory},
        "layout": pr.as_dict()["parallel"], "layout_name": pr.name(), "world": par.world_size,
        "global_batch": global_batch, "micro_batch_size": b, "hardware": hw.as_dict(),
        "params_per_pp_rank": [{"pp_rank": r.pp_rank, "layers": r.layers, "dense": r.dense,
                                "expert": r.expert, "total": r.total, "breakdown": r.breakdown}
                               for r in ranks],
        "memory": pr.memory.as_dict(), "usable_memory": hw.memory * mem_fraction,
        "fits": pr.fits,
        "compute": {"convention": "2 FLOPs per multiply-add; attention not causal-halved",
                    "forward_per_token": fwd, "attention_forward_per_token": attn,
                    "backward_per_token": 2 * fwd, "model_per_token": mf,
                    "recompute_per_token": compute.recompute_flops_per_token(m, par.recompute),
                    "model_per_step": mf * tokens, "per_rank_per_step": mf * tokens
                    / par.world_size,
                    "time_wall": {"tokens": train_tokens, "flops_6psid": wall,
                                  "seconds_at_predicted_mfu": compute.training_seconds(
                                      wall, par.world_size, hw.peak_flops, max(pr.mfu, 1e-9)),
                                  "one_device_at_peak_seconds": wall / hw.peak_flops}},
        "traffic": {"pp_rank": pr.slow_rank, "bytes_by_group": pr.traffic,
                    "collectives": pr.as_dict()["collectives"]},
        "time": {"components": pr.times, "step_seconds": pr.step_seconds,
                 "tokens_per_s": pr.tokens_per_s, "mfu": pr.mfu, "bubble_fraction": pr.bubble,
                 "bubble_ticks": bubble_formulas.bubble_ticks(par), "efficiency": efficiency},
    }
