"""``fived generate``: sample text from a fived checkpoint or a Hugging Face directory.

The model, the tokenizer and the prompts are resolved and checked here, before torch is
imported or any rank starts (every bad input is one ConfigError naming its flag, exit 2). Each
rank then builds only its tensor-parallel piece (``fived.infer.model``, read straight from the
files) and runs ``fived.infer.generate``; rank 0 streams one prompt's text as it comes (several
prompts print when the batch ends) and ends with a table of what it measured. docs/generate.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import ConfigError, ModelConfig
from ..ui.args import Parser

EXAMPLES = """examples:
  fived train --save-dir runs/ck --steps 200 && fived generate --from runs/ck --prompt "def "
  fived generate --from runs/ck/step-000200 --prompt "import os" --temperature 0 --json
  fived generate --hf hf_model --prompts prompts.txt --tp 2 --max-new-tokens 64
"""


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived generate", description="Sample text from a trained model with a KV cache, "
        "on one rank or tensor-parallel (--tp N local ranks, or under torchrun). Each rank "
        "reads only its slices of the weights.", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--from", dest="ckpt", metavar="DIR",
                     help="a fived checkpoint: a save directory (its newest step) or DIR/step-N")
    src.add_argument("--hf", metavar="DIR", help="a local Hugging Face Llama/Mixtral directory")
    m.add_argument("--tokenizer", metavar="SPEC",
                   help="'byte', a tokenizer.json (or a directory holding one) or a `fived data "
                        "prepare` directory (default: the one the checkpoint was trained with; "
                        "the --hf directory's tokenizer.json)")
    m.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="compute dtype (default: the checkpoint's precision; fp32 for --hf)")
    m.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel degree: N local ranks (or torchrun's world; default 1)")
    p = ap.add_argument_group("prompts and sampling")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat the flag for several: they run as one batch)")
    p.add_argument("--prompts", metavar="FILE",
                   help="a file of prompts, one per line (blank lines skipped), one batch")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate per prompt (default: 64)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="softmax temperature; 0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens (default: 0, no cut)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P",
                   help="nucleus: the smallest set of tokens with probability >= P (default: "
                        "0.95; 1 = no cut)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating after the end-of-text token")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON document (each prompt's token ids and text, the "
                         "timings) on stdout instead of the text and the table")
    return ap


# ------------------------------------------------------------------ resolving the inputs
def _tokenizer(spec: str, flag: str = "--tokenizer") -> Any:
    from ..data import tokenizer as tokenize

    p = Path(spec)
    if p.is_dir() and (p / "meta.json").is_file() and not (p / "tokenizer.json").is_file():
        from ..data.shards import DataDir

        return DataDir(p).tokenizer()
    return tokenize.load(spec)


def _checkpoint_tokenizer(man: dict[str, Any], given: str | None, ckpt: Path,
                          flag: str = "--from") -> Any:
    if given:
        return _tokenizer(given)
    data = man.get("data") or {}
    if data.get("source") == "builtin":
        from ..data.tokenizer import ByteTokenizer

        return ByteTokenizer()
    if data.get("source") == "data" and data.get("dir"):
        from ..data.shards import DataDir

        d = Path(data["dir"])
        if (d / "meta.json").is_file():
            dd = DataDir(d)
            if dd.tokenizer_hash == data.get("tokenizer_hash"):
                return dd.tokenizer()
        raise ConfigError([f"{flag} {ckpt}: it was trained on --data {d}, whose tokenizer is "
                           "not there (or changed); give --tokenizer (that directory, or its "
                           "tokenizer.json)"])
    raise ConfigError([f"{flag} {ckpt}: the checkpoint records no tokenizer (an imported "
                       "model?); give --tokenizer SPEC (a tokenizer.json, a data directory or "
                       "'byte')"])


def resolve_model(args) -> tuple[str, str, ModelConfig, Any, str]:
    """(kind, path, model config, tokenizer, dtype name) of --from / --hf."""
    if args.ckpt:
        from ..checkpoint.storage import check_metadata, read_manifest, resolve

        ckpt = resolve(args.ckpt, "--from")
        man = read_manifest(ckpt, "--from")
        check_metadata(ckpt, "--from")
        cfg = ModelConfig(**man["config"]["model"])
        tok = _checkpoint_tokenizer(man, args.tokenizer, ckpt)
        dtype = args.dtype or man["config"]["parallel"].get("precision", "fp32")
        return "ckpt", str(ckpt), cfg, tok, dtype if dtype in ("fp32", "bf16", "fp16") else "fp32"
    if args.hf:
        from ..checkpoint import hf

        conf = hf.read_config(args.hf, "--hf")
        cfg = hf.model_config(conf, "--hf", int(conf.get("max_position_embeddings") or 4096))
        spec = args.tokenizer or args.hf
        if not args.tokenizer and not (Path(args.hf) / "tokenizer.json").is_file():
            raise ConfigError([f"--hf {args.hf}: no tokenizer.json in it; give --tokenizer SPEC"])
        return "hf", args.hf, cfg, _tokenizer(spec), args.dtype or "fp32"
    raise ConfigError(["give the model: --from DIR (a fived checkpoint) or --hf DIR"])


def read_prompts(args) -> list[str]:
    texts = list(args.prompt)
    if any(t == "" for t in texts):
        raise ConfigError(["--prompt: an empty prompt (give at least one character)"])
    if args.prompts:
        f = Path(args.prompts)
        if not f.is_file():
            raise ConfigError([f"--prompts {args.prompts}: no such file"])
        lines = [ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not lines:
            raise ConfigError([f"--prompts {args.prompts}: no prompt in it (only blank lines)"])
        texts += lines
    if not texts:
        raise ConfigError(["give a prompt: --prompt TEXT (repeatable) or --prompts FILE"])
    return texts


def check_tp(cfg: ModelConfig, tp: int) -> None:
    bad = []
    if tp < 1:
        bad.append(f"--tp {tp}: give a degree >= 1")
    else:
        for what, n in (("heads", cfg.heads), ("vocab", cfg.vocab), ("ffn", cfg.ffn)):
            if n % tp:
                bad.append(f"--tp {tp} does not divide the model's {what} ({n})")
        if cfg.kv_heads % tp and tp % cfg.kv_heads:
            bad.append(f"--tp {tp}: the model's kv_heads ({cfg.kv_heads}) must divide tp or "
                       "be divisible by it")
        if cfg.is_moe and cfg.shared_expert and cfg.shared_ffn % tp:
            bad.append(f"--tp {tp} does not divide the shared expert's width "
                       f"({cfg.shared_ffn})")
    if bad:
        raise ConfigError(bad)


def encode(tok: Any, texts: list[str], cfg: ModelConfig, max_new: int) -> list[list[int]]:
    ids = tok.encode_batch(texts)
    bad = []
    for t, p in zip(texts, ids):
        short = t if len(t) <= 30 else t[:27] + "..."
        if not p:
            bad.append(f"prompt {short!r}: the tokenizer gives no tokens")
        elif max(p) >= cfg.vocab:
            bad.append(f"prompt {short!r}: token id {max(p)} is outside the model's vocabulary "
                       f"({cfg.vocab}): --tokenizer is not the model's")
        elif len(p) + max_new > cfg.seq_len:
            what = ("is longer than" if len(p) >= cfg.seq_len
                    else f"+ --max-new-tokens {max_new} exceed")
            bad.append(f"prompt {short!r}: its {len(p)} tokens {what} the model's sequence "
                       f"length ({cfg.seq_len})")
    if bad:
        raise ConfigError(bad)
    return ids


# ------------------------------------------------------------------ the command
def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from ..ranks.launch import torchrun_env

    env = torchrun_env()
    say = env is None or env[0] == 0  # under torchrun, rank 0 speaks
    if say:
        print("fived generate: resolving the model and the prompts ...", file=sys.stderr,
              flush=True)
    for flag, v, ok in (("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1),
                        ("--temperature", args.temperature, args.temperature >= 0),
                        ("--top-k", args.top_k, args.top_k >= 0),
                        ("--top-p", args.top_p, 0 < args.top_p <= 1)):
        if not ok:
            raise ConfigError([f"{flag} {v}: out of range (see fived generate --help)"])
    kind, path, cfg, tok, dtype = resolve_model(args)
    texts = read_prompts(args)
    tp = env[1] if env is not None else args.tp
    check_tp(cfg, tp)
    ids = encode(tok, texts, cfg, args.max_new_tokens)
    job = dict(kind=kind, path=path, cfg=asdict(cfg), dtype=dtype, tokenizer=tok.spec,
               ids=ids, texts=texts, max_new=args.max_new_tokens, ignore_eos=args.ignore_eos,
               sampling=dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed),
               stream=len(texts) == 1 and not args.json)
    if say:
        print(f"{cfg.name}: {len(texts)} prompt(s), {sum(map(len, ids))} tokens, tp{tp}, "
              f"{dtype}, from {path}", file=sys.stderr, flush=True)
    from ..infer.generate import rank_job
    from ..ranks.launch import run_local, run_torchrun

    if env is not None:
        doc = run_torchrun(rank_job, (job,))
        if env[0] != 0:
            return 0
    elif tp == 1:
        doc = rank_job(0, 1, job)
    else:
        doc = run_local(rank_job, tp, (job,))[0]
    show(doc, texts, tp, args.json, job["stream"])
    return 0


def show(doc: dict[str, Any], texts: list[str], tp: int, as_json: bool, streamed: bool) -> None:
    new = sum(len(t) for t in doc["tokens"])
    steps = doc["decode_steps"]
    decode_tps = len(texts) * steps / doc["decode_s"] if doc["decode_s"] > 0 and steps else 0.0
    prefill_tps = doc["prompt_tokens"] / doc["prefill_s"] if doc["prefill_s"] > 0 else 0.0
    total_s = doc["prefill_s"] + doc["decode_s"]
    summary = {"new_tokens": new, "tokens_per_s": new / total_s if total_s else 0.0,
               "time_to_first_token_s": doc["prefill_s"], "prefill_tokens_per_s": prefill_tps,
               "decode_tokens_per_s": decode_tps, "tp": tp}
    if as_json:
        doc = {"prompts": [{"prompt": p, "tokens": t, "text": x}
                           for p, t, x in zip(texts, doc["tokens"], doc["text"])],
               **{k: doc[k] for k in ("prompt_tokens", "prefill_s", "decode_s", "decode_steps",
                                      "cache_bytes", "weights_bytes", "traffic_bytes")},
               **summary}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from ..ui import report

    if not streamed:
        for p, x in zip(texts, doc["text"]):
            print(f"--- {p!r}\n{p}{x}")
    con = report.console()
    t = report.table(None, [("measured", "l"), ("value", "r")])
    rows = [("prompts · prompt tokens · new tokens", f"{len(texts)} · {doc['prompt_tokens']} · {new}"),
            ("time to first token (prefill)", report.fmt_s(doc["prefill_s"])),
            ("prefill tokens/s", f"{prefill_tps:,.0f}"),
            ("decode tokens/s (all prompts)", f"{decode_tps:,.1f}"),
            ("KV cache per rank", report.fmt_b(doc["cache_bytes"])),
            ("weights per rank", report.fmt_b(doc["weights_bytes"])),
            ("tp bytes sent per rank", report.fmt_b(doc["traffic_bytes"]))]
    for a, b in rows:
        t.add_row(a, b)
    report.show(con, t)
    print(f"{new} tokens, {summary['tokens_per_s']:.1f} tokens/s, time to first token "
          f"{doc['prefill_s']:.3f} s (tp{tp})")
