"""``fived bench generate``: fived's KV-cache generation against transformers' ``generate``.

One random Llama (``--model`` preset, shape flags override it) is saved as a Hugging Face
directory; fived reads it at ``--tp`` (each rank its slices, ``fived.infer``) and transformers
loads it whole (``LlamaForCausalLM``, SDPA attention, its dynamic KV cache, fp32), on the same
threads (tp ranks × threads per rank). Each repetition runs, alternating who goes first, for
each side: a generation of 1 token (the prefill: one forward of batch × prompt tokens and the
first pick) and one of ``--new-tokens`` greedy tokens; so

    prefill_s = t(1)          decode_s (per step) = (t(N) − t(1)) / (N − 1)

measured the same way for both. Rows: ``prefill tpN`` and ``decode tpN``, transformers the peer;
the ratio is fived's time over transformers' (the median of the per-repetition ratios), below
1 faster. The greedy tokens of both sides are compared (``extra.same_tokens``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

from ..ui.args import Parser
from . import schema


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="fived bench generate", description=__doc__.splitlines()[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="example:\n  fived bench generate --model small --tp 2 "
                "--reps 5\n  fived bench generate --hidden 1024 --layers 24 "
                "--heads 16 --kv-heads 8 --ffn 2816 --vocab 32000 --seq-len 256")
    ap.add_argument("--model", default="small", metavar="PRESET",
                    help="the model preset the shape starts from (default: small)")
    for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, metavar="N",
                        help=f"the model's {name.replace('_', ' ')} (default: the preset's)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor-parallel degree of fived (local ranks; default 1)")
    ap.add_argument("--batch", type=int, default=1, help="prompts per batch (default 1)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated (default 32)")
    ap.add_argument("--reps", type=int, default=5, help="alternating repetitions (median)")
    ap.add_argument("--json", action="store_true",
                    help="print the fived.bench JSON document alone on stdout")
    return ap


def bench_config(args: argparse.Namespace):
    from dataclasses import replace

    from ..config import ConfigError, preset

    cfg = preset(args.model)
    over = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn",
                                          "vocab", "seq_len") if getattr(args, k) is not None}
    cfg = replace(cfg, name=cfg.name + ("*" if over else ""), experts=0, **over)
    bad = [f"--{k.replace('_', '-')} must be >= 1" for k, v in over.items() if v < 1]
    if args.prompt_len + args.new_tokens > cfg.seq_len:
        bad.append(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceed "
                   f"the model's --seq-len {cfg.seq_len}")
    for flag, value, least in (("--new-tokens", args.new_tokens, 2), ("--batch", args.batch, 1),
                               ("--prompt-len", args.prompt_len, 1), ("--reps", args.reps, 1)):
        if value < least:
            bad.append(f"{flag} {value}: give at least {least}")
    if cfg.heads % args.tp or cfg.vocab % args.tp or cfg.ffn % args.tp or (
            cfg.kv_heads % args.tp and args.tp % cfg.kv_heads):
        bad.append(f"--tp {args.tp} does not divide the model's heads, kv heads, vocab or ffn")
    if bad:
        raise ConfigError(bad)
    return cfg


def save_hf(cfg: Any, path: str) -> None:
    import torch
    import transformers

    from ..checkpoint.hf import hf_config

    conf = hf_config(cfg)
    conf.pop("architectures", None)
    conf.pop("model_type", None)
    conf["max_position_embeddings"] = cfg.seq_len
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**conf))
    m.save_pretrained(path)


def _rank(rank: int, world: int, job: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    import transformers

    from ..checkpoint import hf
    from ..comm import ops
    from ..comm.ops import Traffic
    from ..config import ParallelConfig
    from ..infer.generate import generate
    from ..infer.model import inference_model
    from ..ranks.grid import Grid

    path, b, s, n = job["path"], job["batch"], job["prompt_len"], job["new"]
    cfg = hf.model_config(hf.read_config(path, "--hf"), "--hf", job["seq_len"])
    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(Traffic())
    model = inference_model(cfg, grid, hf.HFSource(path, cfg, "--hf"), "cpu")
    gather = (lambda z: ops.all_gather(z, grid["tp"], dim=-1)) if world > 1 else None
    prompts = torch.randint(0, cfg.vocab, (b, s), generator=torch.Generator().manual_seed(1))
    mine = torch.get_num_threads()
    peer = None
    if rank == 0:
        peer = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        peer.generation_config.eos_token_id = None

    def fived_run(k: int) -> tuple[float, list]:
        t0 = time.perf_counter()
        out = generate(model, prompts.tolist(), k, gather=gather)
        return time.perf_counter() - t0, out.tokens

    def peer_run(k: int) -> tuple[float, list]:
        torch.set_num_threads(job["threads"])  # the threads every fived rank has together
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                y = peer.generate(prompts, max_new_tokens=k, do_sample=False, pad_token_id=0,
                                  attention_mask=torch.ones_like(prompts))
                return time.perf_counter() - t0, y[:, s:].tolist()
        finally:
            torch.set_num_threads(mine)

    def both(k: int, first: str) -> dict[str, float]:
        times, toks = {}, {}
        for who in ((first, "peer" if first == "fived" else "fived")):
            if who == "fived":
                times[who], toks[who] = fived_run(k)
            elif rank == 0:
                times[who], toks[who] = peer_run(k)
            if world > 1:
                dist.barrier()
        if rank == 0 and k == n:
            both.same &= toks["fived"] == toks["peer"]
        return times

    both.same = True
    both(2, "fived")  # warm-up
    rec: dict[str, list[float]] = {"fived_prefill": [], "fived_decode": [], "peer_prefill": [],
                                   "peer_decode": []}
    for r in range(job["reps"]):
        first = "fived" if r % 2 == 0 else "peer"
        t1, tn = both(1, first), both(n, first)
        if rank == 0:
            for who in ("fived", "peer"):
                rec[f"{who}_prefill"].append(t1[who])
                rec[f"{who}_decode"].append(max(tn[who] - t1[who], 1e-9) / (n - 1))
        if rank == 0 and job["progress"]:
            print(f"  rep {r + 1}/{job['reps']}: prefill {t1['fived']:.4f} s vs "
                  f"{t1['peer']:.4f} s", file=sys.stderr, flush=True)
    return {**rec, "same": both.same} if rank == 0 else None


@schema.json_stdout
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    cfg = bench_config(args)
    from ..ui.report import fold

    print(fold(f"fived bench generate: {cfg.name} (hidden {cfg.hidden}, {cfg.layers} layers, "
               f"vocab {cfg.vocab}) tp{args.tp}, batch {args.batch} × {args.prompt_len} prompt "
               f"tokens, {args.new_tokens} new, {args.reps} reps vs transformers generate",
               indent="  "), file=sys.stderr, flush=True)
    import os

    import torch

    from ..ranks.launch import run_local, threads_per_rank

    # the threads fived's ranks have together: the peer gets as many
    threads = threads_per_rank(args.tp) * args.tp if args.tp > 1 else torch.get_num_threads()
    with tempfile.TemporaryDirectory() as d:
        save_hf(cfg, d)
        job = dict(path=d, batch=args.batch, prompt_len=args.prompt_len, new=args.new_tokens,
                   seq_len=cfg.seq_len, reps=args.reps, threads=threads, progress=True)
        res = (_rank(0, 1, job) if args.tp == 1 else run_local(_rank, args.tp, (job,),
                                                                timeout=3600)[0])
    tag = f"tp{args.tp}"
    b, s = args.batch, args.prompt_len
    rows = []
    for what, tokens in (("prefill", b * s), ("decode", b)):
        for who, name in (("peer", "transformers"), ("fived", "fived")):
            ts = res[f"{who}_{what}"]
            med = statistics.median(ts)
            rows.append(schema.row(f"{what} {tag}", name, med, peer=who == "peer",
                                   times_s=ts, tokens_per_s=tokens / med))
    doc = schema.document("generate", argv, rows, settings=vars(args),
                          extra={"same_tokens": res["same"], "threads": threads,
                                 "cpus": os.cpu_count()},
                          mach=schema.machine(threads_per_rank=threads // args.tp))
    if args.json:
        schema.emit(doc)
        return 0
    from ..ui import report

    con = report.console()
    t = report.table(f"generation, {cfg.name} {tag}: fived / transformers (below 1: faster)",
                     [("phase", "l"), ("who", "l"), ("median", "r"), ("tokens/s", "r"),
                      ("ratio", "r")])
    for r in doc["rows"]:
        t.add_row(r["variant"], r["implementation"], report.fmt_s(r["step_s"]),
                  f"{r['extra']['tokens_per_s']:,.0f}", f"{r['ratio']:.3f}")
    report.show(con, t)
    print(f"greedy tokens equal: {'yes' if res['same'] else 'NO'}")
    return 0
