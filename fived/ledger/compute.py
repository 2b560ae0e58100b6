"""FLOPs of the Llama-style decoder.

Convention: a multiply-add is 2 FLOPs; attention is *not* causal-halved (the PaLM / Megatron
MFU convention), so per token, forward:

    F_fwd = 2·Ψ_matmul + 4·L·s·(heads·head_dim)

with Ψ_matmul the parameters used in matrix multiplies per token (every linear, the head, and
for MoE only the top-k experts; the embedding lookup is free). Backward is twice forward, so
model FLOPs per token = 3·F_fwd = 6·Ψ_matmul + 12·L·s·h_attn. Recompute FLOPs are extra
hardware work and are not model FLOPs.
"""

from __future__ import annotations

from ..config import ModelConfig


def matmul_params(m: ModelConfig) -> int:
    """Parameters touched by one token's matrix multiplies (active experts only)."""
    hd = m.head_dim
    attn = m.hidden * (m.heads * hd) * 2 + m.hidden * (m.kv_heads * hd) * 2
    if m.is_moe:
        mlp = 3 * m.hidden * m.expert_ffn * m.top_k + m.hidden * m.experts
        if m.shared_expert:
            mlp += 3 * m.hidden * m.expert_ffn
    else:
        mlp = 3 * m.hidden * m.ffn
    return m.layers * (attn + mlp) + m.hidden * m.vocab


def forward_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    s = seq_len or m.seq_len
    return 2.0 * matmul_params(m) + 4.0 * m.layers * s * m.heads * m.head_dim


def model_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    """Forward + backward model FLOPs per token (3× forward)."""
    return 3.0 * forward_flops_per_token(m, seq_len)
