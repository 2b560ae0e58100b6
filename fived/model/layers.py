"""The building blocks every layout shares: RMSNorm, RoPE, the attention core and the loss.

Linear layers are plain ``torch.nn.Linear`` (no bias, but on q/k/v with ``qkv_bias``) and the
embedding is ``torch.nn.Embedding``; parallel dimensions replace modules of the built model
(``fived.parallel``), the model itself never asks how it is laid out. The attention core and
the loss are modules of their own so that context parallelism can swap the core and tensor
parallelism the loss.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .documents import row_segments

STD = 0.02  # the init std of every weight matrix (residual outputs: STD / √(2·layers))


class _SwiGLU(torch.autograd.Function):
    """silu(g) ⊙ u that saves only g and u (Megatron's ``SwiGLUFunction``): backward recomputes
    silu(g) instead of keeping it and the product (both ffn wide); the gradients are the bits
    plain autograd computes."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors  # the kernels autograd runs for silu(g) * u, silu recomputed
        return torch.ops.aten.silu_backward(dy * u, g), dy * F.silu(g)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) ⊙ u, saving g and u only (the product is saved by the down projection)."""
    return _SwiGLU.apply(g, u)


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs (float64 stays float64, for gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNorm(torch.autograd.Function):
    """x · r · w, r = 1/sqrt(mean(x²) + eps), in fp32 (or wider); saves x (as given) and r (fp32, one per
    token) — what a fused kernel keeps (Apex/TE ``rsigma``); x̂ = x·r is recomputed."""

    @staticmethod
    def forward(ctx, x, w, eps):
        xf = x.to(_math_dtype(x))
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, w)
        return (xf * r * w.to(xf.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, r, w = ctx.saved_tensors
        xhat = x.to(r.dtype) * r
        gf = g.to(r.dtype)
        dw = (gf * xhat).flatten(0, -2).sum(0).to(w.dtype)
        dxhat = gf * w.to(r.dtype)
        dx = r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), dw, None


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) ⊙ up x)."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g, computed in fp32 (saves x and the fp32 1/rms only)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


class Yarn(NamedTuple):
    """YaRN's rope scaling (Peng et al. 2023, as DeepSeek-V3's config.json states it): the
    extension ``factor``, the pre-training length ``original``, the ramp's rotation bounds
    ``beta_fast`` / ``beta_slow``, and the ``gain`` the cos/sin tables are multiplied by."""

    factor: float
    original: int
    beta_fast: float
    beta_slow: float
    gain: float


def inverse_frequencies(dim: int, theta: float, yarn: Yarn | None = None,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """θ^(−2i/dim), i < dim/2, in float64; with YaRN, each frequency blends its interpolated
    value (÷ factor) and itself by a linear ramp over the dimensions whose wavelength makes
    between beta_fast and beta_slow rotations in ``original`` positions (bounds floored and
    ceiled, as transformers' ``truncate``)."""
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    if yarn is None:
        return inv

    def at(rotations: float) -> float:
        return dim * math.log(yarn.original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = max(math.floor(at(yarn.beta_fast)), 0), min(math.ceil(at(yarn.beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=device) - lo) / (hi - lo)
            ).clamp(0, 1)
    return inv / yarn.factor * ramp + inv * (1 - ramp)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                dtype=torch.float32, yarn: Yarn | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (*positions.shape, head_dim/2) for the (possibly non-contiguous)
    ``positions`` — (s,) in training, (b, s) per row when generating — in ``dtype`` (rounded
    through fp32: the values any dtype's tables had when they were cast per layer); one pair
    per forward, which every layer's ``apply_rope`` saves without a copy. With ``yarn`` the
    frequencies are YaRN's and both tables carry its gain."""
    inv = inverse_frequencies(head_dim, theta, yarn, positions.device)
    ang = positions.to(torch.float64)[..., None] * inv
    cos, sin = ang.cos(), ang.sin()
    if yarn is not None and yarn.gain != 1.0:
        cos, sin = cos * yarn.gain, sin * yarn.gain
    return cos.float().to(dtype), sin.float().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the head dimension; x is (b, s, heads, d), the tables (s, d/2)
    or (b, s, d/2)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d + causal mask) v with grouped-query heads; (b, s, h, d) in and out.

    K/V keep their kv heads (SDPA's ``enable_gqa``): the flash kernel saves q, k, v, the output
    and the fp32 log-sum-exp, nothing else. On meta tensors (the dry run) SDPA has no fused
    kernel to pick and would fall back to materialised probabilities; there the CUDA flash op
    runs itself (it has a meta implementation and takes the kv heads as they are)."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.device.type == "meta":
        o = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True,
                                                               scale=scale)[0]
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                           enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d where ``allowed``) v: q (b, n, h, d) new queries against the cached
    keys and values k, v (b, t, kv_heads, d), ``allowed`` (b, 1, n, t) bool (generation's
    causal-and-not-padding mask, ``fived.model.cache``); (b, n, h, d) out."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed,
                                       scale=1.0 / math.sqrt(q.shape[-1]),
                                       enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


causal_attention = flash_attention  # the name context parallelism and the benchmarks call


def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  docs: torch.Tensor) -> torch.Tensor:
    """Causal attention within documents; q (b, s, h, d), k/v (b, s, g, d), docs (b, s).

    Per-document varlen: every (row, document) segment is one fused causal SDPA call on its
    own tokens; a row of one document is one call over the row, as without a mask. Segments
    of equal length across rows share a call."""
    b, s = q.shape[0], q.shape[1]
    if docs.shape != (b, s):
        raise ValueError(f"document ids {tuple(docs.shape)} do not match the queries ({b}, {s})")
    segs = row_segments(docs)
    if all(len(x) == 1 for x in segs):
        return causal_attention(q, k, v)
    by_len: dict[int, list[tuple[int, int]]] = {}
    for r, row in enumerate(segs):
        for a, e in row:
            by_len.setdefault(e - a, []).append((r, a))
    out = torch.empty_like(q)  # every token belongs to exactly one segment: all rows written
    parts, where = [], []
    for n, items in by_len.items():
        qs = torch.stack([q[r, a:a + n] for r, a in items])
        ks = torch.stack([k[r, a:a + n] for r, a in items])
        vs = torch.stack([v[r, a:a + n] for r, a in items])
        parts.append(causal_attention(qs, ks, vs))
        where.append(items)
    # scatter through index_put (autograd-friendly), one index per token
    rows, cols, vals = [], [], []
    for o, items in zip(parts, where):
        n = o.shape[1]
        for r, a in items:
            rows.append(torch.full((n,), r, dtype=torch.long))
            cols.append(torch.arange(a, a + n))
        vals.append(o.reshape(-1, *o.shape[2:]))
    ri, ci = torch.cat(rows).to(q.device), torch.cat(cols).to(q.device)
    return out.index_put((ri, ci), torch.cat(vals))


class CausalAttention(nn.Module):
    """The attention core over the whole sequence (context parallelism replaces it)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        if docs is not None:  # --doc-mask: per-document varlen
            return doc_attention(q, k, v, docs)
        return causal_attention(q, k, v)  # the one name every caller (and a test's patch) uses


IGNORE = -1  # a target that adds nothing to the loss (multi-token prediction's last positions)


class _TokenCE(torch.autograd.Function):
    """Σ_t (lse_t − z_t[target_t]), z the logits in fp32, lse their log-sum-exp, over the
    tokens whose target is not ``IGNORE``. Saves the logits as given (the compute dtype: no
    fp32 copy in bf16), the fp32 lse (one per token) and the targets; backward recomputes
    softmax(z) = exp(z − lse) from them (zero rows for ignored tokens)."""

    @staticmethod
    def forward(ctx, logits, targets):
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        ctx.save_for_backward(logits, lse, targets)
        valid = targets != IGNORE
        per = lse - z.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        return torch.where(valid, per, 0.0).sum()

    @staticmethod
    def backward(ctx, g):
        logits, lse, targets = ctx.saved_tensors
        p = (logits.float() - lse.unsqueeze(-1)).exp_()
        valid = targets != IGNORE
        p.scatter_add_(-1, targets.clamp_min(0).unsqueeze(-1),
                       valid.unsqueeze(-1).to(p.dtype).neg())
        return (p * (g * valid.unsqueeze(-1).to(p.dtype))).to(logits.dtype), None


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the cross-entropy (tokens whose target is ``IGNORE`` add nothing), in
    fp32, keeping one copy of the logits in their own dtype for backward (``_TokenCE``). A
    DTensor (``fived bench tp``'s torch peer, under
    its ``loss_parallel``) takes torch's own cross-entropy."""
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is not None and isinstance(logits, dt.DTensor):
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")
    return _TokenCE.apply(logits.flatten(0, -2), targets.flatten())


class TokenLoss(nn.Module):
    """Σ over tokens of CE(logits, targets) (tensor parallelism swaps in the vocab-parallel one)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_losses(logits, targets)


class TiedHead(nn.Module):
    """Logits from the embedding matrix (tied input and output embeddings). The embedding is
    referenced, not registered, so its weight keeps the one name ``embed_tokens.weight``."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        object.__setattr__(self, "embedding", embedding)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.embedding.weight)
