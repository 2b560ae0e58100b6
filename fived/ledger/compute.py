"""FLOPs of the Llama-style decoder, and the time wall.

Convention: a multiply-add is 2 FLOPs; attention is *not* causal-halved (the PaLM / Megatron
MFU convention: the scores and the score-weighted values cost 2·2·s·(heads·head_dim) per token
per layer as if no position were masked; with MLA 2·s·heads·(d_q + d_v), ``fived.ledger.mla``),
so per token, forward:

    F_fwd = 2·Ψ_matmul + 4·L·s·(heads·head_dim)

with Ψ_matmul the parameters used in matrix multiplies per token (every linear, the head, and
for MoE only the top-k experts plus the router; the embedding lookup is free). Backward is
twice forward, so model FLOPs per token = 3·F_fwd = 6·Ψ_matmul + 12·L·s·h_attn. Pass
``causal=True`` for the halved attention term (the work a causal kernel actually does).

Multi-token prediction (``mtp_depth`` D) adds per token, forward, per module k: its
projection 2·(2h·h), its block (2·Ψ_block + 4·s·h_attn, like a trunk layer of index L + k) and
the shared head again 2·h·V — counted as model FLOPs (the modules are trained, and run over
every position: the last k have no target, their work is done anyway). DeepSeek-V3's weights
README counts 1.5B activated parameters in its one module (0.9B of them the shared head)
against 36.6B in the main model: about 4 % more matmul FLOPs per token.

Recompute FLOPs are extra hardware work and are *not* model FLOPs: ``full`` recompute adds one
forward (F_fwd per token), ``selective`` adds the attention core's forward (4·L·s·h_attn).

The time wall (Kaplan et al. 2020; Hoffmann et al. 2022): training on D tokens costs ≈ 6·Ψ·D
FLOPs; a 7B model on 1T tokens is 6·7e9·1e12 = 4.2e22 FLOPs — at 400 TFLOP/s sustained,
1.05e8 s ≈ 3.3 GPU-years.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import mla
from .params import block_matmul_params, layer_cfg, layers_matmul_params


def mtp_matmul_params(m: ModelConfig) -> int:
    """Parameters one token's matrix multiplies touch in the D MTP modules: eh_proj (2h·h),
    the block (active experts) and the shared head (h·V), per module."""
    return sum(2 * m.hidden * m.hidden + block_matmul_params(layer_cfg(m, m.layers + k))
               + m.hidden * m.vocab for k in range(m.mtp_depth))


def matmul_params(m: ModelConfig) -> int:
    """Parameters touched by one token's matrix multiplies (active experts only; the MTP
    modules' too)."""
    return layers_matmul_params(m, range(m.layers)) + m.hidden * m.vocab + mtp_matmul_params(m)


def attention_flops_per_token(m: ModelConfig, seq_len: int | None = None, causal: bool = False,
                              layers: int | None = None) -> float:
    """Forward FLOPs of QKᵀ and PV per token (all layers and the MTP blocks, or ``layers``
    blocks)."""
    s = seq_len or m.seq_len
    n = m.layers + m.mtp_depth if layers is None else layers
    full = n * mla.core_flops_per_token(m, s) if m.is_mla else 4.0 * n * s * m.heads * m.head_dim
    return full / 2 if causal else full


def doc_context(seq_len: int, mean: float | None = None,
                lengths: list[int] | None = None) -> float:
    """The keys a token attends to on average under document masks (``--doc-mask``), in the
    convention above (not causal-halved): Σ Lᵢ² / S over the document pieces Lᵢ of the windows,
    instead of S. ``lengths``: the documents' token counts in stream order (a prepared split's
    ``.idx.npy`` differences), packed back to back and cut into windows of ``seq_len`` as the
    loader cuts them — exact for that stream (the incomplete last window dropped; a stream
    shorter than one window counts as one); ``mean``: documents of that length (64 windows)."""
    S = seq_len
    if lengths is None:
        if mean is None or mean <= 0:
            raise ValueError("doc_context needs a mean document length or the lengths")
        mu = max(1, int(round(mean)))
        lengths = [mu] * (64 * S // mu + 2)
    full, cur, room, windows = 0.0, 0.0, S, 0
    for L in lengths:
        while L > 0:
            piece = min(L, room)
            cur += piece * piece
            L -= piece
            room -= piece
            if room == 0:
                full, cur, room, windows = full + cur, 0.0, S, windows + 1
    if windows == 0:
        return cur / max(S - room, 1)
    return full / (windows * S)


def forward_flops_per_token(m: ModelConfig, seq_len: int | None = None,
                            causal: bool = False) -> float:
    return 2.0 * matmul_params(m) + attention_flops_per_token(m, seq_len, causal)


def model_flops_per_token(m: ModelConfig, seq_len: int | None = None) -> float:
    """Forward + backward model FLOPs per token (3× forward, attention not causal-halved)."""
    return 3.0 * forward_flops_per_token(m, seq_len)


def recompute_flops_per_token(m: ModelConfig, recompute: str, seq_len: int | None = None,
                              causal: bool = False) -> float:
    """Extra (hardware, not model) FLOPs per token that recompute costs."""
    if recompute == "full":
        return forward_flops_per_token(m, seq_len, causal)
    if recompute == "selective":
        return attention_flops_per_token(m, seq_len, causal)
    return 0.0


def training_flops(params: float, tokens: float) -> float:
    """The 6ΨD rule: FLOPs to train ``params`` parameters on ``tokens`` tokens."""
    return 6.0 * params * tokens


def training_seconds(flops: float, gpus: int, peak_flops: float, mfu: float = 1.0) -> float:
    """Wall-clock seconds for ``flops`` on ``gpus`` devices at ``mfu`` of ``peak_flops`` each."""
    return flops / (gpus * peak_flops * mfu)


def stage_forward_flops_per_token(m: ModelConfig, layers, last: bool,
                                  seq_len: int | None = None, causal: bool = False) -> float:
    """Forward FLOPs per token for a pipeline piece of ``layers`` blocks (+ head when last):
    their global ids (a model with ``first_dense_layers``), or a count of MoE-shaped blocks."""
    if isinstance(layers, int):
        mm, n = block_matmul_params(m) * layers, layers
    else:
        ids = list(layers)
        mm, n = layers_matmul_params(m, ids), len(ids)
    f = 2.0 * mm + attention_flops_per_token(m, seq_len, causal, n)
    if last:  # the head, and the MTP modules (their blocks' attention included)
        f += 2.0 * m.hidden * m.vocab + 2.0 * mtp_matmul_params(m)
        f += attention_flops_per_token(m, seq_len, causal, m.mtp_depth)
    return f
