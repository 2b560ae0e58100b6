"""Sampling with a KV cache: prefill the prompts in one forward, then one token per forward.

For prompts p_1 … p_b (token ids), left-padded to the longest length s:

    prefill   logits_r = model(pad(p_r), positions_r)[last]      one forward of b·s tokens
    decode    t_r ← pick(logits_r);  logits_r = model(t_r, n_r)   one forward of b tokens,
                                                                  n_r the row's next position

until ``max_new_tokens`` or every row has produced ``eos``. Positions count each row's real
tokens (padding takes none), and the cache's mask hides the padding (``fived.model.cache``), so
a row gives the tokens it gives alone. ``pick`` is greedy at temperature 0; otherwise softmax of
logits / T restricted to the ``top_k`` largest and to the smallest set of probability mass
≥ ``top_p`` (nucleus), drawn from a generator seeded by ``seed``.

Under tensor parallelism each rank holds V/tp of the logits; ``gather`` (an all-gather over
the tp group) makes the whole row on every rank, and every rank draws with the same generator,
so all ranks pick the same tokens without another collective. ``vocab`` cuts the padded
vocabulary (a model row past the tokenizer's symbols is never picked).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..model.cache import KVCache


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1: no cut
    seed: int = 0


@dataclass
class Generated:
    tokens: list[list[int]]  # the new tokens of each prompt (eos included when produced)
    prompt_tokens: int = 0
    prefill_s: float = 0.0  # the prefill forward and the first pick: time to first token
    decode_s: float = 0.0  # every later forward and pick
    decode_steps: int = 0  # forwards after the prefill
    cache_bytes: int = 0

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """(b, V) fp32 logits -> (b,) token ids."""
    if s.temperature <= 0:
        return logits.argmax(-1)
    z = logits / s.temperature
    if 0 < s.top_k < z.shape[-1]:
        kth = z.topk(s.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if s.top_p < 1.0:
        sz, order = z.sort(dim=-1, descending=True)
        p = sz.softmax(-1)
        drop = p.cumsum(-1) - p >= s.top_p  # mass before this token already reaches top_p
        z = z.scatter(-1, order, sz.masked_fill(drop, float("-inf")))
    return torch.multinomial(z.softmax(-1), 1, generator=gen).squeeze(-1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), eos: int | None = None, vocab: int | None = None,
             gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
             on_token: Callable[[int, int], None] | None = None) -> Generated:
    """New tokens for each prompt (lists of ids); ``on_token(row, id)`` as each one comes."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    dev = next(model.parameters()).device
    b, s = len(prompts), max(len(p) for p in prompts)
    x = torch.zeros(b, s, dtype=torch.long)
    real = torch.zeros(b, s, dtype=torch.bool)
    for r, p in enumerate(prompts):
        x[r, s - len(p):] = torch.tensor(p, dtype=torch.long)
        real[r, s - len(p):] = True
    x, real = x.to(dev), real.to(dev)
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    after = torch.tensor([len(p) for p in prompts], device=dev)[:, None]  # next positions
    cache = KVCache(b, s + max_new_tokens, dev)
    gen = None
    if sampling.temperature > 0:
        gen = torch.Generator(device=dev).manual_seed(sampling.seed)

    def next_tokens(logits: torch.Tensor) -> torch.Tensor:
        z = logits[:, -1].float()
        z = gather(z) if gather is not None else z
        return pick(z[:, :vocab] if vocab is not None else z, sampling, gen)

    out = Generated([[] for _ in range(b)], prompt_tokens=sum(len(p) for p in prompts))
    _sync(dev)
    t0 = time.perf_counter()
    cache.begin(real)
    tok = next_tokens(model(x, positions, cache=cache)).tolist()
    out.prefill_s = time.perf_counter() - t0
    done = [False] * b
    ones = torch.ones(b, 1, dtype=torch.bool, device=dev)
    t1 = time.perf_counter()
    for step in range(max_new_tokens):
        for r, t in enumerate(tok):
            if not done[r]:
                out.tokens[r].append(t)
                done[r] = t == eos
                if on_token is not None:
                    on_token(r, t)
        if all(done) or step == max_new_tokens - 1:
            break
        cache.begin(ones)
        logits = model(torch.tensor(tok, device=dev)[:, None], after, cache=cache)
        after = after + 1
        tok = next_tokens(logits).tolist()
        out.decode_steps += 1
    out.decode_s = time.perf_counter() - t1
    out.cache_bytes = cache.nbytes()
    return out


# ------------------------------------------------------------------ each rank
def _stream(tok: Any) -> Any:
    """on_token for one prompt: print the new text as it decodes (held back while a multibyte
    character is incomplete)."""
    ids: list[int] = []
    shown = [0]

    def on_token(row: int, t: int) -> None:
        ids.append(t)
        text = tok.decode(ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(text)
    return on_token


def rank_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """``fived generate`` on one rank: ``job`` is what the command resolved (the model, its
    source, the tokenizer's spec, the prompts' ids, the sampling); rank 0 streams one prompt's
    text and returns the measurements."""
    from ..comm import ops
    from ..comm.ops import Traffic
    from ..config import ModelConfig, ParallelConfig
    from ..data.tokenizer import from_spec
    from ..parallel.parallelize import dtype_of
    from ..ranks.grid import Grid
    from ..ranks.launch import device_and_backend, rank_device
    from .model import inference_model, param_bytes

    cfg = ModelConfig(**job["cfg"])
    traffic = Traffic()
    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(traffic)
    # one rank, no process group: the GPU if there is one (device_and_backend's rule)
    device = rank_device() if world > 1 else device_and_backend()[0]
    if job["kind"] == "ckpt":
        from ..checkpoint.convert import CheckpointSource
        from ..checkpoint.storage import read_manifest

        source = CheckpointSource(job["path"], read_manifest(Path(job["path"]), "--from"))
    else:
        from ..checkpoint.hf import HFSource

        source = HFSource(job["path"], cfg, "--hf")
    model = inference_model(cfg, grid, source, device, dtype_of(job["dtype"]))
    tok = from_spec(job["tokenizer"])
    tp = grid["tp"]
    gather = (lambda z: ops.all_gather(z, tp, dim=-1)) if world > 1 else None
    stream = rank == 0 and job["stream"]
    if stream:
        sys.stdout.write(job["texts"][0])
        sys.stdout.flush()
    out = generate(model, job["ids"], job["max_new"], Sampling(**job["sampling"]),
                   None if job["ignore_eos"] else tok.eos, tok.vocab, gather,
                   _stream(tok) if stream else None)
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if rank != 0:
        return None
    doc = asdict(out)
    doc["text"] = [tok.decode(t) for t in out.tokens]
    doc["weights_bytes"] = param_bytes(model)
    doc["traffic_bytes"] = traffic.bytes_by_dim().get("tp", 0.0)
    return doc
