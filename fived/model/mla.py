"""Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3): keys and values through a latent.

For a token x (hidden h), H heads, the latent widths r_q = ``q_lora_rank`` and r_kv =
``kv_lora_rank``, the per-head widths d_n = ``qk_nope_head_dim``, d_r = ``qk_rope_head_dim``,
d_v = ``v_head_dim``:

    q      = W_qb · N_q(W_qa x)            (H·(d_n + d_r); with r_q = 0: q = W_q x)
    [c; kᴿ] = W_kva x                        (r_kv + d_r: the latent and one rotary key)
    [kᴺ; v] = W_kvb · N_kv(c)               (H·(d_n + d_v), per head)
    q_h = [qᴺ_h ; RoPE(qᴿ_h)],   k_h = [kᴺ_h ; RoPE(kᴿ)]   (kᴿ shared by every head)
    o   = W_o · [softmax(q_h k_hᵀ · τ + causal) v_h]_h ,   τ = m² / √(d_n + d_r)

N_q, N_kv are RMSNorms (ε = 1e-6, DeepSeek's and transformers' latent norms whatever
``norm_eps`` says); m = 0.1·``rope_mscale_all_dim``·ln(``rope_factor``) + 1 with YaRN
(1 without). τ is applied by scaling q by m² (the core divides by √(d_n + d_r) itself).

The core (``self_attn.core``, ``MLACore``) takes v at its own width d_v: the fused kernel takes
one head width, so ``NarrowVFlash`` zero-pads v to d_q around the kernel and cuts its output
back, and saves q, k (d_q), v and the output at d_v and the log-sum-exp — what a kernel taking
v at d_v (cuDNN's, Megatron-Core's) saves; backward pads v, the output and its gradient again
(zero columns change none of the kernel's sums: the gradients are the padded core's, bit for
bit). The output is o_proj's input without a copy. Context parallelism swaps the core for its
own, which takes one width: there v is padded before the core and the output cut after it;
its latent ring (a core with ``takes_latent``) takes the latent [c ; kᴿ] and W_kvb instead
and up-projects each block it holds itself. RoPE rotates halves
(fived's ``apply_rope``); DeepSeek's checkpoints rotate interleaved pairs, which the Hugging Face
import turns into halves by permuting the rotary rows of W_qb (W_q) and W_kva
(``fived.checkpoint.hf``): the scores are the same numbers.

``rope_key`` is a plug point, the identity here: the rotary key kᴿ is used by every head, so
when tensor parallelism cuts the heads each rank's gradient of it is partial; the plan
(``fived.parallel.tensor``) swaps in the module that sums it over tp (and gathers the sequence
with SP). Names are DeepSeek's and transformers' ``DeepseekV3Attention``'s:
``q_proj`` | ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``; ``o_proj``.

Generation keeps the latent: per token and layer r_kv + d_r values (c after its norm, kᴿ after
RoPE) in the ``KVCache`` slots of keys and values — against GQA's 2·kv_heads·head_dim. Each
forward expands the cached latent through W_kvb (``absorb = False``), or folds W_kvb's key half
into the query and its value half into the output (``absorb = True``: q̃ = qᴺ·W_kbᵀ attends to
c directly, o_h = (softmax · c) W_vbᵀ), which needs no per-token expansion; the default
``"auto"`` absorbs for decode steps and expands at prefill.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import layers as nn_layers
from .cache import LayerCache

ABSORB_BELOW = 8  # generation's "auto": absorbed for fewer new tokens (decode), expanded at
# prefill (benchmarks/mla_generate.py measured both on this CPU: docs/generate.md)
LATENT_EPS = 1e-6  # the latent norms' epsilon (DeepSeek's RMSNorm default; transformers' too)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention gain 0.1·m·ln(factor) + 1 (1 for factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_of(cfg: ModelConfig) -> nn_layers.Yarn | None:
    """The YaRN scaling of ``cfg``'s RoPE (None: plain RoPE). The cos/sin gain is
    mscale(f, mscale)/mscale(f, mscale_all_dim) when both are set, else mscale(f) — as
    transformers' ``_compute_yarn_parameters`` has it."""
    if not cfg.yarn:
        return None
    f = cfg.rope_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        gain = yarn_mscale(f, cfg.rope_mscale) / yarn_mscale(f, cfg.rope_mscale_all_dim)
    else:
        gain = yarn_mscale(f)
    return nn_layers.Yarn(f, cfg.rope_original_max_positions, cfg.rope_beta_fast,
                          cfg.rope_beta_slow, gain)


def softmax_gain(cfg: ModelConfig) -> float:
    """m²: the softmax scale's YaRN correction (1 without YaRN or mscale_all_dim)."""
    if not cfg.yarn or not cfg.rope_mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


class NarrowVFlash(torch.autograd.Function):
    """Causal flash attention with v narrower than q and k, all (b, s, H, ·): the fused
    kernel (the CPU one; on meta tensors, the dry run, the CUDA one) over v zero-padded to
    q's width, the output cut back to v's; saves q, k, v, the output (contiguous: the next
    matmul's input) and the log-sum-exp (on meta also the kernel's RNG seed and offset)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dq, dv = q.shape[-1], v.shape[-1]
        ctx.scale = 1.0 / math.sqrt(dq)
        v = v.contiguous()
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        vt = F.pad(v, (0, dq - dv)).transpose(1, 2)
        if q.device.type == "meta":
            r = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True,
                                                                   scale=ctx.scale)
            o, lse, rng = r[0], r[1], (r[6], r[7])
        else:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, True, scale=ctx.scale)
            rng = ()
        out = o.transpose(1, 2)[..., :dv].contiguous()
        ctx.save_for_backward(q, k, v, out, lse, *rng)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        q, k, v, out, lse, *rng = ctx.saved_tensors
        pad = q.shape[-1] - v.shape[-1]
        gt, vt, ot = (F.pad(t, (0, pad)).transpose(1, 2) for t in (g, v, out))
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        if q.device.type == "meta":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                gt, qt, kt, vt, ot, lse, None, None, q.shape[1], k.shape[1], 0.0, True,
                rng[0], rng[1], scale=ctx.scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gt, qt, kt, vt, ot, lse, 0.0, True, scale=ctx.scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)[..., :v.shape[-1]]


class MLACore(nn_layers.CausalAttention):
    """MLA's attention core: q, k (b, s, H, d_q), v (b, s, H, d_v) -> (b, s, H, d_v).
    ``NarrowVFlash`` when v is narrower (on the CPU or meta); with document ids, or on
    another device, v padded to d_q around the plain core and the output cut back."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        dq, dv = q.shape[-1], v.shape[-1]
        if dv == dq:
            return super().forward(q, k, v, docs)
        if docs is None and q.device.type in ("cpu", "meta"):
            return NarrowVFlash.apply(q, k, v)
        return super().forward(q, k, F.pad(v, (0, dq - dv)), docs)[..., :dv]


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring); (b, s, h) in and out."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, H = cfg.hidden, cfg.heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rkv = cfg.kv_lora_rank
        dq = self.dn + self.dr
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False, dtype=dtype)
            self.q_a_layernorm = nn_layers.RMSNorm(cfg.q_lora_rank, LATENT_EPS, dtype)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * dq, bias=False, dtype=dtype)
        else:
            self.q_proj = nn.Linear(h, H * dq, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rkv + self.dr, bias=False, dtype=dtype)
        self.kv_a_layernorm = nn_layers.RMSNorm(self.rkv, LATENT_EPS, dtype)
        self.kv_b_proj = nn.Linear(self.rkv, H * (self.dn + self.dv), bias=False, dtype=dtype)
        self.o_proj = nn.Linear(H * self.dv, h, bias=False, dtype=dtype)
        self.rope_key = nn.Identity()  # tensor parallelism sums its gradient over tp
        self.core = MLACore()  # context parallelism swaps in its own core
        self.gain = softmax_gain(cfg)
        # generation: fold W_kvb into the query and output (True), expand the cached latent
        # (False), or "auto": absorbed when fewer new tokens than ABSORB_BELOW (decode steps)
        self.absorb: bool | str = "auto"

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
                cache: LayerCache | None = None) -> torch.Tensor:
        cos, sin = rope[0], rope[1]  # a third item: the document ids (--doc-mask)
        dn, dr = self.dn, self.dr
        x = x.contiguous()  # a strided SP shard: one copy both down-projections share
        q = self.query(x)
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, dn + dr)
        if self.gain != 1.0:
            q = q * self.gain
        q = torch.cat([q[..., :dn], nn_layers.apply_rope(q[..., dn:], cos, sin)], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rkv, dr], dim=-1)
        c = self.kv_a_layernorm(c)
        k_rope = nn_layers.apply_rope(self.rope_key(k_rope).unsqueeze(2), cos, sin)
        if cache is not None:  # generation: the latent is what is cached
            return self.o_proj(self.cached(q, c, k_rope, cache).reshape(b, s, -1))
        o = self.attend(q, c, k_rope, None if len(rope) == 2 else rope[2])
        return self.o_proj(o.reshape(o.shape[0], o.shape[1], -1))

    def expand(self, c: torch.Tensor, k_rope: torch.Tensor, pad: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent (b, t, r_kv) and rotary key (b, t, 1, d_r) -> per-head k (b, t, H, d_n + d_r)
        and v, zero-padded to the same width (``pad``) or at d_v, contiguous."""
        kv = self.kv_b_proj(c)
        b, t = kv.shape[0], kv.shape[1]
        k_nope, v = kv.view(b, t, -1, self.dn + self.dv).split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if pad:
            return k, F.pad(v, (0, self.dn + self.dr - self.dv))
        return k, v.contiguous()

    def attend(self, q: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor,
               docs: torch.Tensor | None) -> torch.Tensor:
        """(b, s, H, d_v): MLA's own core takes v at d_v; a swapped one (context
        parallelism's) gets v padded to d_q and its output is cut back; a core that takes the
        latent (``takes_latent``: the latent ring) gets (q, [c ; kᴿ], W_kvb) and up-projects
        itself."""
        if getattr(self.core, "takes_latent", False):
            latent, w = self.core.latent_of(self, c, k_rope)
            dims = (self.dn, self.dv)
            return (self.core(q, latent, w, dims) if docs is None
                    else self.core(q, latent, w, dims, docs))
        own = isinstance(self.core, MLACore)
        k, v = self.expand(c, k_rope, pad=not own)
        o = self.core(q, k, v) if docs is None else self.core(q, k, v, docs)
        return o if own else o[..., :self.dv]

    def cached(self, q: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor,
               cache: LayerCache) -> torch.Tensor:
        """The new queries against every cached latent: (b, n, H, d_v)."""
        c_all, kr_all, allowed = cache.update(c.unsqueeze(2), k_rope)
        c_all = c_all.squeeze(2)  # (b, t, r_kv), kr_all (b, t, 1, d_r)
        absorb = q.shape[1] < ABSORB_BELOW if self.absorb == "auto" else self.absorb
        if not absorb:
            k, v = self.expand(c_all, kr_all)
            return nn_layers.masked_attention(q, k, v, allowed)[..., :self.dv]
        # absorbed: scores = qᴺ·W_kb·c + qᴿ·kᴿ, output = (p·c)·W_vbᵀ (per head)
        dn, dv = self.dn, self.dv
        w = self.kv_b_proj.weight.view(-1, dn + dv, self.rkv)  # (H, d_n + d_v, r_kv)
        w_k, w_v = w[:, :dn], w[:, dn:]
        q_lat = torch.einsum("bnhd,hdr->bnhr", q[..., :dn], w_k)  # (b, n, H, r_kv)
        scores = (torch.einsum("bnhr,btr->bhnt", q_lat, c_all)
                  + torch.einsum("bnhd,btd->bhnt", q[..., dn:], kr_all.squeeze(2)))
        scores = scores / math.sqrt(dn + self.dr)
        p = scores.float().masked_fill(~allowed, float("-inf")).softmax(-1).to(c_all.dtype)
        o_lat = torch.einsum("bhnt,btr->bnhr", p, c_all)
        return torch.einsum("bnhr,hvr->bnhv", o_lat, w_v)
