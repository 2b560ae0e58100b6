"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied embeddings.

    h₀ = E[tokens]
    hᵢ₊₁ = hᵢ' + W_down( silu(W_gate n) ⊙ W_up n ),   n = RMSNorm(hᵢ'),
    hᵢ'  = hᵢ + W_o · Attn(RoPE(N_q(W_q m + b_q)), RoPE(N_k(W_k m + b_k)), W_v m + b_v),
    m = RMSNorm(hᵢ)
    loss = Σ_tokens CE(W_head · RMSNorm(h_L), targets)

Attention shapes (``ModelConfig``): q and the attention output are heads·head_dim wide, k and v
kv_heads·head_dim, where head_dim is ``head_size`` or hidden/heads; the biases b_q, b_k, b_v
exist with ``qkv_bias`` (Qwen2; otherwise 0), and N_q, N_k — an RMSNorm over head_dim applied to
every head alone, one gain vector (head_dim) for all heads — with ``qk_norm`` (Qwen3; otherwise
the identity).

A plain ``nn.Module``: it knows nothing of any layout. Parameter names follow Hugging Face's
Llama (and Mixtral, ``fived.model.moe``) without the ``model.`` prefix — ``embed_tokens``,
``layers.{i}.self_attn.{q,k,v,o}_proj`` (``.bias`` on q, k, v with ``qkv_bias``),
``layers.{i}.self_attn.{q,k}_norm`` (``qk_norm``), ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.{input,post_attention}_layernorm``, ``norm``, ``lm_head`` — so a Hugging Face
state dict maps onto it by renaming alone. Head counts come from the tensors (``view(b, s, -1, d)``), so a
column-cut projection simply yields fewer heads.

A ``Transformer`` may hold a contiguous part of the stack (``layer_ids``, with the embedding when
``first`` and the final norm, head and loss when ``last``): layers keep their global indices, so a
part's parameters have the names they have in the whole model (``part`` cuts one from a model).

Multi-token prediction (``mtp_depth`` D > 0, ``fived.model.mtp``): ``mtp.{k}.{enorm, hnorm,
eh_proj, block, norm}`` after the head, ``block`` a ``Block`` at index layers + k; the last part
holds them, and with them (or with tied embeddings) the embedding too (``holds_embedding``:
under a pipeline the first and the last stage both hold ``embed_tokens.weight``, the embedding
group sums its gradient). Training's objective is L⁰ + λ/D·Σ Lᵏ; without gradients (evaluation)
the modules do not run.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..config import ModelConfig
from . import layers as nn_layers
from .cache import KVCache, LayerCache
from .documents import Documents
from .init import init_weights
from .mla import MLAttention, yarn_of
from .moe import MoE
from .mtp import MultiTokenPrediction

STD = nn_layers.STD
OUT_PROJECTIONS = ("o_proj", "down_proj", "w2")  # residual outputs: std / √(2·layers)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        d, h, bias = cfg.head_dim, cfg.hidden, cfg.qkv_bias
        self.head_dim = d
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=False, dtype=dtype)
        if cfg.qk_norm:  # one gain over head_dim, shared by every head (Qwen3)
            self.q_norm = nn_layers.RMSNorm(d, cfg.norm_eps, dtype)
            self.k_norm = nn_layers.RMSNorm(d, cfg.norm_eps, dtype)
        self.core = nn_layers.CausalAttention()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: LayerCache | None = None) -> torch.Tensor:
        cos, sin = rope[0], rope[1]  # a third item: the document ids (--doc-mask)
        q = self.q_proj(x)
        b, s, d = q.shape[0], q.shape[1], self.head_dim
        q, k = q.view(b, s, -1, d), self.k_proj(x).view(b, s, -1, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = nn_layers.apply_rope(q, cos, sin), nn_layers.apply_rope(k, cos, sin)
        v = self.v_proj(x).view(b, s, -1, d)
        if cache is None:
            o = self.core(q, k, v) if len(rope) == 2 else self.core(q, k, v, rope[2])
        else:  # generation: the new keys/values join the cached ones (fived.model.cache)
            o = nn_layers.masked_attention(q, *cache.update(k, v))
        return self.o_proj(o.reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = nn_layers.RMSNorm(cfg.hidden, cfg.norm_eps, dtype)
        self.self_attn = MLAttention(cfg, dtype) if cfg.is_mla else Attention(cfg, dtype)
        self.post_attention_layernorm = nn_layers.RMSNorm(cfg.hidden, cfg.norm_eps, dtype)
        if cfg.is_moe_layer(index):  # the first ``first_dense_layers`` blocks stay dense
            self.block_sparse_moe = MoE(cfg, index, dtype)
        else:
            self.mlp = nn_layers.MLP(cfg.hidden, cfg.ffn, dtype)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: LayerCache | None = None) -> torch.Tensor:
        n = self.input_layernorm(h)  # training calls attention with (x, rope), as it always did
        h = h + (self.self_attn(n, rope) if cache is None else self.self_attn(n, rope, cache))
        return h + self.ffn(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """The decoder, or the contiguous part ``layer_ids`` of it (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_ids: list[int] | None = None, first: bool = True,
                 last: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        ids = list(range(cfg.layers)) if layer_ids is None else list(layer_ids)
        if holds_embedding(cfg, first, last):
            self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dtype)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, dtype) for i in ids})
        if last:
            self.norm = nn_layers.RMSNorm(cfg.hidden, cfg.norm_eps, dtype)
            if cfg.tied_embeddings:
                self.lm_head = nn_layers.TiedHead(self.embed_tokens)
            else:
                self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dtype)
            self.loss = nn_layers.TokenLoss()
            if cfg.mtp_depth:
                blocks = [Block(cfg, cfg.layers + k, dtype) for k in range(cfg.mtp_depth)]
                self.mtp = MultiTokenPrediction(cfg.hidden, cfg.norm_eps, blocks,
                                                cfg.mtp_loss_weight, dtype)

    @property
    def layer_ids(self) -> list[int]:
        return [int(k) for k in self.layers]

    def param_std(self, name: str) -> float:
        """The init std of parameter ``name``: 0 (ones) for norms (q/k norms too), smaller for
        residual outputs; the q/k/v biases are drawn like their weights."""
        if name.endswith("norm.weight"):
            return 0.0
        if name.split(".")[-2] in OUT_PROJECTIONS:
            return STD / math.sqrt(2 * self.cfg.layers)
        return STD

    def init_weights(self, seed: int) -> Transformer:
        """Every parameter drawn from (seed, its name): the same model whatever is built."""
        return init_weights(self, seed, self.param_std)

    def part(self, layer_ids: list[int], first: bool, last: bool) -> Transformer:
        """A part of this model holding ``layer_ids`` (+ embedding / head): shares its modules."""
        p = Transformer(self.cfg, [], False, False)
        p.first, p.last = first, last
        del p.layers  # registered again below, after the embedding: the whole model's order
        if holds_embedding(self.cfg, first, last):  # (ZeRO-3 with pp lays a chunk's flat
            p.embed_tokens = self.embed_tokens       # buffer out in this order; the ledger too)
        p.layers = nn.ModuleDict()
        for i in layer_ids:
            p.layers[str(i)] = self.layers[str(i)]
        if last:
            p.norm, p.lm_head, p.loss = self.norm, self.lm_head, self.loss
            if hasattr(self, "mtp"):
                p.mtp = self.mtp
        return p

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                targets: torch.Tensor | None = None, cache: KVCache | None = None
                ) -> torch.Tensor:
        """Tokens (first part) or hidden states in; hidden states, logits, or — when ``targets``
        are given on the last part — the summed token loss out.

        Generation (``cache``, after ``cache.begin``): ``positions`` are (b, s), each row's
        own; the keys and values join the cache, and the logits are the last slot's only.
        ``--doc-mask``: ``positions`` is a ``Documents`` (per-row positions and document ids,
        ``fived.model.documents``); the ids reach every attention core with the rope tables."""
        docs = None
        if isinstance(positions, Documents):
            positions, docs = positions.positions, positions.docs
        h = self.embed_tokens(x) if self.first else x
        rope = nn_layers.rope_tables(positions, self.cfg.rope_dim, self.cfg.rope_theta, h.dtype,
                                     yarn_of(self.cfg))
        if docs is not None:
            rope = (*rope, docs)
        for i, block in self.layers.items():
            h = block(h, rope) if cache is None else block(h, rope, LayerCache(cache, int(i)))
        if cache is not None:
            cache.advance()
            h = h[:, -1:]
        if not self.last:
            return h
        normed = self.norm(h)
        logits = self.lm_head(normed)
        if targets is None:
            return logits
        loss = self.loss(logits, targets)
        if hasattr(self, "mtp") and torch.is_grad_enabled() and cache is None:
            loss = loss + self.mtp(normed, targets, rope, self.embed_tokens,
                                   self.lm_head, self.loss)
        return loss


def holds_embedding(cfg: ModelConfig, first: bool, last: bool) -> bool:
    """The first part holds the embedding; the last one too when it reads it (tied head,
    multi-token prediction's shifted tokens)."""
    return first or (last and (cfg.tied_embeddings or cfg.mtp_depth > 0))


def build_model(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None, init: bool = True) -> Transformer:
    """The whole model on ``device`` (default: torch's default device), initialised from
    ``seed``; ``init=False`` skips the draw (the dry run: fake tensors have no values)."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = Transformer(cfg, dtype=dtype)
    return model.init_weights(seed) if init else model
