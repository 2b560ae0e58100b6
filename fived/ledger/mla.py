"""Multi-head latent attention's weights and FLOPs (``fived.model.mla``), torch-free.

With h the hidden width, H heads, r_q = ``q_lora_rank``, r_kv = ``kv_lora_rank``, d_n, d_r,
d_v the per-head widths and d_q = d_n + d_r, one block's attention holds

    q_a_proj h·r_q, q_a_layernorm r_q, q_b_proj r_q·H·d_q     (r_q > 0; else q_proj h·H·d_q)
    kv_a_proj_with_mqa h·(r_kv + d_r), kv_a_layernorm r_kv
    kv_b_proj r_kv·H·(d_n + d_v), o_proj H·d_v·h

Tensor parallelism cuts the up-projections (q_b_proj or q_proj, kv_b_proj) and o_proj tp ways
by heads; the down-projections and the latent norms are whole on every tp rank
(``fived.parallel.tensor``'s MLA rows). DeepSeek-V3 (h 7168, H 128, r_q 1536, r_kv 512, d_n
128, d_r 64, d_v 128): 187,107,328 attention parameters per block (q_b 1536·128·192 =
37,748,736; kv_b 512·128·256 = 16,777,216; o 128·128·7168 = 117,440,512; q_a 11,010,048;
kv_a 4,128,768; norms 2,048).

The attention core per token and layer, forward, in the MFU convention of
``fived.ledger.compute`` (not causal-halved): q·kᵀ over d_q and p·v over d_v,

    2·s·H·(d_q + d_v)      (GQA's 4·s·heads·head_dim when d_q = d_v = head_dim)

The runtime's flash core pads v to d_q (its kernel takes one head width), so the hardware does
4·s·H·d_q; the model FLOPs count d_v, as Megatron-Core's MLA FLOPs do.

Under the latent ring (``--cp-mode ring-latent``) each cp rank up-projects every block it
holds, its own and the cp − 1 it receives, and again in backward, where each block's dK/dV
also goes back through W_kvb (dlatent and W_kvb's gradient). Per layer and micro-batch of t
tokens on a rank, W_kvb's products (each 2·t·r_kv·(H/tp)·(d_n + d_v) FLOPs) are

    forward  cp            (1 without it)
    backward 3·cp          (cp re-expansions, cp dlatent, cp dW; 2 without it)

so the ring adds 4·(cp − 1) + 1 products per layer: hardware FLOPs, not the model's (MFU
counts one). With a block of s_b = s/cp tokens the forward's extra over a full core block is
r_kv·(d_n + d_v)/(s_b·(d_q + d_v)) (409.6/s_b at DeepSeek-V3's shape).
"""

from __future__ import annotations

from ..config import ModelConfig


def weights(m: ModelConfig, tp: int = 1) -> list[tuple[str, int, bool]]:
    """(name under ``self_attn.``, elements on one tp rank, whole on every tp rank), in the
    module's registration order."""
    h, H, dq = m.hidden, m.heads, m.qk_head_dim
    rq, rkv, dr, dn, dv = (m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim,
                           m.qk_nope_head_dim, m.v_head_dim)
    out = ([("q_a_proj.weight", h * rq, True), ("q_a_layernorm.weight", rq, True),
            ("q_b_proj.weight", rq * H * dq // tp, False)] if rq
           else [("q_proj.weight", h * H * dq // tp, False)])
    return out + [("kv_a_proj_with_mqa.weight", h * (rkv + dr), True),
                  ("kv_a_layernorm.weight", rkv, True),
                  ("kv_b_proj.weight", rkv * H * (dn + dv) // tp, False),
                  ("o_proj.weight", H * dv * h // tp, False)]


def by_kind(m: ModelConfig, tp: int = 1) -> dict[str, int]:
    """One block's MLA elements on one tp rank by kind: ``mla_down`` (the down-projections),
    ``mla_norm`` (the latent norms), ``mla_up`` (the up-projections or q_proj), ``wo``."""
    out = {"mla_down": 0, "mla_norm": 0, "mla_up": 0, "wo": 0}
    for name, n, _ in weights(m, tp):
        kind = ("wo" if name.startswith("o_proj") else "mla_norm" if "layernorm" in name
                else "mla_down" if name.startswith(("q_a_", "kv_a_")) else "mla_up")
        out[kind] += n
    return out


def replicated(m: ModelConfig, tp: int) -> int:
    """Elements of one block's MLA every tp rank holds whole."""
    return sum(n for _, n, whole in weights(m, tp) if whole)


def matmul_params(m: ModelConfig) -> int:
    """Parameters one token's attention matmuls touch in one block (every weight but the
    norms)."""
    return sum(n for name, n, _ in weights(m) if "layernorm" not in name)


def core_flops_per_token(m: ModelConfig, s: int) -> float:
    """Forward FLOPs of q·kᵀ and p·v for one token in one layer, not causal-halved."""
    return 2.0 * s * m.heads * (m.qk_head_dim + m.v_head_dim)


def kv_b_products(cp: int, latent_ring: bool) -> tuple[int, int]:
    """(forward, backward) W_kvb products per layer and micro-batch on one rank, each over
    the rank's t tokens: (1, 2) — the matmul, then dX and dW —, or under the latent ring
    (cp, 3·cp) — every block up-projected, and in backward again, with its dX and dW."""
    return (cp, 3 * cp) if latent_ring and cp > 1 else (1, 2)
