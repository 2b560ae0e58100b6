"""Parameter counts: the whole Llama-style model (dense or MoE), and one rank's share of a layout.

Every weight of ``fived.model.llama`` is counted by name (no biases anywhere):

    per block    attn_norm h, mlp_norm h                         (RMSNorm gains, replicated)
                 wq h·(heads·d), wk h·(kv·d), wv h·(kv·d), wo (heads·d)·h
                 (d = head_dim: ``head_size``, or h / heads)
                 qkv_bias (heads + 2·kv)·d                       (``qkv_bias``: q, k, v biases)
                 qk_norm 2·d                                     (``qk_norm``: q, k norm gains)
                 dense MLP: w_gate h·f, w_up h·f, w_down f·h     (SwiGLU)
                 MoE MLP:   router h·E + E·3·h·f_e (+ 3·h·f_s shared expert, + h its gate)
    once         embed V·h, final norm h, head h·V (absent when tied_embeddings)
    per MTP module (``mtp_depth`` D, ``fived.model.mtp``), on the last stage:
                 enorm h, hnorm h, eh_proj 2h·h, a block (of layer L + k's shape), norm h
                 (the embedding and the head are the trunk's)

Known totals (tests): Llama-2-7B 6,738,415,616; Llama-3-8B 8,030,261,248; Llama-3-70B
70,553,706,496.

One rank's share (``rank_params``) follows the runtime's cuts:

* tp: wq, wo, w_gate, w_up, w_down, embed and head are cut tp ways; wk, wv are cut
  ``min(tp, kv_heads)`` ways (replicated beyond that), and the q/k/v biases with them; norms
  (the q/k norms too), the MoE router and the routed experts are replicated (a shared expert
  is cut tp ways along the expert ffn).
* pp: (virtual) stage k holds its layers (``pp_layers``, or ``balanced_split``: the split that
  minimises the costliest stage, head and embedding included, as the pipeline partitions);
  pipeline rank r holds virtual stages r, r+pp, r+2·pp, ... (V-shaped schedules: r and
  2pp−1−r). The embedding sits on virtual stage 0 (rank 0),
  the final norm and head on the last virtual stage (rank pp−1), with the MTP modules. With
  tied embeddings or MTP the last stage holds the embedding too (V·h/tp more on it; Megatron's
  embedding group sums the two copies' gradients, ``embed_copies``).
* MTP modules: the block cut as a trunk block; enorm, hnorm, eh_proj and norm whole on every
  tp rank.
* ep: each ep rank holds E/ep experts, each a full SwiGLU (experts are never cut across tp:
  they are replicated over tp, as ``fived.model.moe`` builds them). Expert parameters are reduced
  over the ``expert`` group, everything else over ``dense``.

``param_list`` lists one rank's parameters in the runtime's registration order (embedding,
blocks — attn_norm, wq (its bias), wk (bias), wv (bias), wo, q_norm, k_norm, mlp_norm, then
w_gate, w_up, w_down or router, experts, shared expert — final norm, head, then each MTP
module: enorm, hnorm, eh_proj, its block, norm), which is what the data-parallel engine lays
its flat buckets out from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..config import V_SCHEDULES, ModelConfig, ParallelConfig, fp8_gather_applies
from . import mla


# ------------------------------------------------------------------------ whole model
def dense_block_cfg(m: ModelConfig) -> ModelConfig:
    """The shape of a MoE model's first ``first_dense_layers`` blocks: a dense MLP of width
    ``ffn`` (DeepSeek-MoE), i.e. the same model without experts."""
    return replace(m, experts=0, first_dense_layers=0)


def layer_cfg(m: ModelConfig, layer: int) -> ModelConfig:
    """The shape block ``layer`` is built with (``m``, or ``dense_block_cfg`` for a leading
    dense block of a MoE model)."""
    return dense_block_cfg(m) if m.is_moe and layer < m.first_dense_layers else m


def layer_kinds(m: ModelConfig, layers) -> list[tuple[ModelConfig, int]]:
    """[(block shape, how many of ``layers`` (global ids) have it)] — one entry for a uniform
    model, the dense and the MoE shape when ``first_dense_layers`` > 0."""
    ids = list(layers)
    dense = sum(1 for i in ids if m.is_moe and i < m.first_dense_layers)
    if not dense:
        return [(m, len(ids))]
    return [(dense_block_cfg(m), dense), (m, len(ids) - dense)]


def block_params(m: ModelConfig) -> dict[str, int]:
    """Parameters of one transformer block, by weight name (unsharded). GPT-style shapes
    (``mlp="gelu"``: up and down only; ``norm="layernorm"``: a bias per norm; ``bias``: a bias
    per linear layer) add or drop entries; the Llama-style defaults are the runtime's."""
    h, d = m.hidden, m.head_dim
    ln = 2 if m.norm == "layernorm" else 1
    out = {
        "attn_norm": ln * h,
        "wq": h * m.heads * d,
        "wk": h * m.kv_heads * d,
        "wv": h * m.kv_heads * d,
        "wo": m.heads * d * h,
        "mlp_norm": ln * h,
    }
    if m.is_mla:  # multi-head latent attention (fived.ledger.mla)
        del out["wq"], out["wk"], out["wv"]
        out.update(mla.by_kind(m))
    if m.bias:
        out["attn_bias"] = (m.heads + 2 * m.kv_heads) * d + h
    if m.qkv_bias:
        out["qkv_bias"] = (m.heads + 2 * m.kv_heads) * d
    if m.qk_norm:
        out["qk_norm"] = 2 * d
    if m.is_moe:
        out["router"] = h * m.experts
        out["experts"] = m.experts * 3 * h * m.expert_ffn
        if m.shared_expert:
            out["shared_expert"] = 3 * h * m.shared_ffn + (h if m.shared_expert_gate else 0)
    else:
        if m.mlp == "swiglu":
            out["w_gate"] = h * m.ffn
        out["w_up"] = h * m.ffn
        out["w_down"] = m.ffn * h
        if m.bias:
            out["mlp_bias"] = (2 if m.mlp == "swiglu" else 1) * m.ffn + h
    return out


def mtp_module_params(m: ModelConfig, k: int) -> dict[str, int]:
    """One multi-token prediction module (k = 0 .. D−1; block index L + k), by kind: its two
    input norms and output norm, eh_proj (2h -> h) and the block."""
    h = m.hidden
    return {"mtp_norms": 3 * h, "eh_proj": 2 * h * h,
            "mtp_block": sum(block_params(layer_cfg(m, m.layers + k)).values())}


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Whole-model parameters by kind: embed, blocks (all layers), norm, head, mtp (the D
    modules' own: DeepSeek-V3's 11.5B "unique" MTP parameters), and total."""
    blocks = sum(sum(block_params(c).values()) * n for c, n in layer_kinds(m, range(m.layers)))
    embed = m.vocab * m.hidden
    head = 0 if m.tied_embeddings else m.hidden * m.vocab
    norm = m.hidden * (2 if m.norm == "layernorm" else 1)
    out = {"embed": embed, "blocks": blocks, "norm": norm, "head": head}
    if m.positions == "learned":
        out["positions"] = m.seq_len * m.hidden
    if m.mtp_depth:
        out["mtp"] = sum(sum(mtp_module_params(m, k).values()) for k in range(m.mtp_depth))
    out["total"] = embed + blocks + norm + head + out.get("positions", 0) + out.get("mtp", 0)
    b = block_params(m)
    out["expert"] = b.get("experts", 0) * (m.moe_layers + (m.mtp_depth if m.is_moe else 0))
    out["dense"] = out["total"] - out["expert"]
    return out


def total_params(m: ModelConfig) -> int:
    return param_counts(m)["total"]


def active_params(m: ModelConfig) -> int:
    """Parameters one token touches (MoE: top_k of the experts)."""
    c = param_counts(m)
    if not m.is_moe:
        return c["total"]
    moe = m.moe_layers + m.mtp_depth  # an MTP module's block is a MoE block
    return c["total"] - c["expert"] + moe * m.top_k * 3 * m.hidden * m.expert_ffn


# ------------------------------------------------------------------------ pipeline split
def block_matmul_params(m: ModelConfig) -> int:
    """Parameters one token's matrix multiplies touch in one block (active experts + router)."""
    hd = m.head_dim
    attn = (mla.matmul_params(m) if m.is_mla
            else m.hidden * (m.heads + 2 * m.kv_heads) * hd + m.heads * hd * m.hidden)
    if m.is_moe:
        mlp = 3 * m.hidden * m.expert_ffn * m.top_k + m.hidden * m.experts
        if m.shared_expert:
            mlp += 3 * m.hidden * m.shared_ffn + (m.hidden if m.shared_expert_gate else 0)
    else:
        mlp = (3 if m.mlp == "swiglu" else 2) * m.hidden * m.ffn
    return attn + mlp


def layers_matmul_params(m: ModelConfig, layers) -> int:
    """``block_matmul_params`` summed over the blocks ``layers`` (global ids)."""
    return sum(block_matmul_params(c) * n for c, n in layer_kinds(m, layers))


def _layer_cost(m: ModelConfig) -> float:
    return 2.0 * block_matmul_params(m) + 4.0 * m.seq_len * m.hidden


@lru_cache(maxsize=4096)
def balanced_split(m: ModelConfig, stages: int) -> tuple[int, ...]:
    """Layers per stage minimising the most expensive stage in forward FLOPs per token, ties to
    the most even split — the pipeline's own rule (``fived.parallel.pipeline.stage``): a layer
    costs 2·(matmul params) + 4·s·h, the last stage adds the head 2·h·V + 5·V, the first the
    embedding h."""
    L = m.layers
    costs = [_layer_cost(layer_cfg(m, i)) for i in range(L)]  # dense leading blocks cost less
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    hc, ec = 2.0 * m.hidden * m.vocab + 5.0 * m.vocab, float(m.hidden)
    hc += sum(_layer_cost(layer_cfg(m, L + k)) + 4.0 * m.hidden * m.hidden + hc  # MTP modules
              for k in range(m.mtp_depth))
    if stages > L:
        raise ValueError(f"{stages} pipeline stages for {L} layers")

    def cost(s: int, start: int, n: int) -> float:
        return (pre[start + n] - pre[start] + (ec if s == 0 else 0.0)
                + (hc if s == stages - 1 else 0.0))

    memo: dict[tuple[int, int], tuple[float, float, tuple[int, ...]]] = {}

    def best(s: int, left: int) -> tuple[float, float, tuple[int, ...]]:
        key = (s, left)
        if key in memo:
            return memo[key]
        if s == stages - 1:
            out = (cost(s, L - left, left), float(left * left), (left,))
        else:
            out = None
            for n in range(1, left - (stages - s - 1) + 1):
                mx, sq, rest = best(s + 1, left - n)
                cand = (max(mx, cost(s, L - left, n)), sq + n * n, (n,) + rest)
                if out is None or cand[:2] < out[:2]:
                    out = cand
        memo[key] = out
        return out

    return best(0, L)[2]


def stage_layers(m: ModelConfig, par: ParallelConfig) -> list[list[int]]:
    """Global layer ids of each virtual stage 0 .. pp·v−1 (``pp_layers``, or the pipeline's
    balanced split)."""
    return [list(x) for x in _stage_layers(m, par.pp * max(1, par.virtual_stages),
                                           tuple(par.pp_layers))]


@lru_cache(maxsize=4096)
def _stage_layers(m: ModelConfig, n: int, pp_layers: tuple[int, ...]
                  ) -> tuple[tuple[int, ...], ...]:
    if pp_layers:
        sizes = list(pp_layers)
    elif n == 1:
        sizes = [m.layers]
    else:
        sizes = list(balanced_split(m, n))
    out, start = [], 0
    for k in sizes:
        out.append(tuple(range(start, start + k)))
        start += k
    return tuple(out)


def rank_stages(par: ParallelConfig, pp_rank: int) -> list[int]:
    """Virtual stages held by pipeline rank ``pp_rank`` (r, r+pp, r+2·pp, ...; the V-shaped
    schedules zb-v and dualpipe-v: r and 2·pp−1−r)."""
    if par.schedule in V_SCHEDULES:
        return sorted({pp_rank, 2 * par.pp - 1 - pp_rank})
    v = max(1, par.virtual_stages)
    return [pp_rank + c * par.pp for c in range(v)]


def rank_layers(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> int:
    st = stage_layers(m, par)
    return sum(len(st[k]) for k in rank_stages(par, pp_rank))


def rank_layer_ids(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> list[int]:
    """Global ids of the blocks pipeline rank ``pp_rank`` holds, its stages in order."""
    st = stage_layers(m, par)
    return [i for k in rank_stages(par, pp_rank) for i in st[k]]


def rank_moe_layers(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> int:
    """MoE blocks on pipeline rank ``pp_rank`` (its blocks less the leading dense ones; the
    last stage's MTP modules' blocks are MoE blocks of a MoE model)."""
    mtp = m.mtp_depth if m.is_moe and par.pp * max(1, par.virtual_stages) - 1 in rank_stages(
        par, pp_rank) else 0
    return sum(1 for i in rank_layer_ids(m, par, pp_rank) if m.is_moe_layer(i)) + mtp


# ------------------------------------------------------------------------ one rank's share
@dataclass
class RankParams:
    """Parameter elements held by one rank, split by the group their gradients reduce over."""

    pp_rank: int
    layers: int
    dense: int  # reduced over ``dense`` (dp·ep·cp)
    expert: int  # reduced over ``expert`` (dp·cp)
    breakdown: dict[str, int] = field(default_factory=dict)  # element counts by kind
    replicated_in_tp: int = 0  # elements every tp rank holds whole (norms, router, kv beyond kv_heads)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def block_params_local(m: ModelConfig, tp: int, ep: int) -> dict[str, int]:
    """One block's elements on one (tp, ep) rank, by weight name."""
    h, d = m.hidden, m.head_dim
    kv_shards = min(tp, m.kv_heads)
    ln = 2 if m.norm == "layernorm" else 1
    out = {
        "attn_norm": ln * h,
        "wq": h * m.heads * d // tp,
        "wk": h * m.kv_heads * d // kv_shards,
        "wv": h * m.kv_heads * d // kv_shards,
        "wo": m.heads * d * h // tp,
        "mlp_norm": ln * h,
    }
    if m.is_mla:  # up-projections and o_proj cut by heads, the rest whole (fived.ledger.mla)
        del out["wq"], out["wk"], out["wv"]
        out.update(mla.by_kind(m, tp))
    if m.bias:  # q/k/v biases cut with their columns, the o_proj bias whole
        out["attn_bias"] = (m.heads * d // tp + 2 * m.kv_heads * d // kv_shards) + h
    if m.qkv_bias:  # cut with their columns
        out["qkv_bias"] = m.heads * d // tp + 2 * m.kv_heads * d // kv_shards
    if m.qk_norm:  # whole on every tp rank
        out["qk_norm"] = 2 * d
    if m.is_moe:
        out["router"] = h * m.experts
        out["experts"] = (m.experts // ep) * 3 * h * m.expert_ffn  # replicated over tp
        if m.shared_expert:  # cut tp ways like an MLP; the gate (h) whole on every tp rank
            out["shared_expert"] = (3 * h * m.shared_ffn // tp
                                    + (h if m.shared_expert_gate else 0))
    else:
        if m.mlp == "swiglu":
            out["w_gate"] = h * m.ffn // tp
        out["w_up"] = h * m.ffn // tp
        out["w_down"] = m.ffn * h // tp
        if m.bias:
            out["mlp_bias"] = (2 if m.mlp == "swiglu" else 1) * m.ffn // tp + h
    return out


def expert_param_bytes(m: ModelConfig, ep: int, layers_on_rank: int | None = None,
                       dtype_bytes: int = 4) -> int:
    """Bytes of routed-expert weights one rank holds: layers · (E/ep) · 3 · h · ffn_e · b."""
    layers = m.moe_layers if layers_on_rank is None else layers_on_rank
    return layers * (m.experts // ep) * 3 * m.hidden * m.expert_ffn * dtype_bytes


def has_head(m: ModelConfig, par: ParallelConfig) -> bool:
    """The runtime builds a separate head unless embeddings are tied (the last stage then reads
    the embedding, its own copy under pp: ``holds_embedding``)."""
    return not m.tied_embeddings


def holds_embedding(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> bool:
    """Whether pipeline rank ``pp_rank`` holds the embedding: the first stage's, or the last
    stage's copy (tied head, multi-token prediction: ``fived.model.llama.holds_embedding``)."""
    stages = rank_stages(par, pp_rank)
    last = par.pp * max(1, par.virtual_stages) - 1
    return 0 in stages or (last in stages and (m.tied_embeddings or m.mtp_depth > 0))


def embed_copies(m: ModelConfig, par: ParallelConfig) -> int:
    """Pipeline ranks holding the embedding: 2 when the first and the last stage are two ranks
    and the last reads it (Megatron's embedding group, summed over ``embed``), else 1."""
    two = par.pp > 1 and par.schedule not in V_SCHEDULES
    return 2 if two and (m.tied_embeddings or m.mtp_depth > 0) else 1


def mtp_params_local(m: ModelConfig, tp: int, ep: int) -> tuple[int, int, int]:
    """(elements, of which replicated over tp, of which routed experts) of the D MTP modules on
    one (tp, ep) rank of the last stage: each block cut as a trunk block, the norms and
    eh_proj whole."""
    total = rep = expert = 0
    for k in range(m.mtp_depth):
        c = layer_cfg(m, m.layers + k)
        blk = block_params_local(c, tp, ep)
        own = 3 * m.hidden + 2 * m.hidden * m.hidden
        total += sum(blk.values()) + own
        rep += own + blk["attn_norm"] + blk["mlp_norm"] + blk.get("router", 0) + blk.get(
            "experts", 0) + blk.get("qk_norm", 0)
        if tp > c.kv_heads:
            rep += blk["wk"] + blk["wv"]
        expert += blk.get("experts", 0)
    return total, rep, expert


def rank_params(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0) -> RankParams:
    """Elements held by a rank at pipeline coordinate ``pp_rank`` (any tp/ep/cp/dp coordinate:
    every such rank holds the same number)."""
    tp, ep = par.tp, par.ep
    stages = rank_stages(par, pp_rank)
    n_stages = par.pp * max(1, par.virtual_stages)
    layers = rank_layers(m, par, pp_rank)
    bd: dict[str, int] = {}
    rep = 0
    for c, n in layer_kinds(m, rank_layer_ids(m, par, pp_rank)):
        blk = block_params_local(c, tp, ep)
        for k, v in blk.items():
            bd[k] = bd.get(k, 0) + v * n
        rep += (blk["attn_norm"] + blk["mlp_norm"] + blk.get("router", 0)
                + blk.get("experts", 0) + blk.get("qk_norm", 0)) * n
        if c.is_mla:
            rep += mla.replicated(c, tp) * n
        elif tp > c.kv_heads:
            rep += (blk["wk"] + blk["wv"]) * n
            if c.qkv_bias:  # the k, v biases of a replicated kv chunk
                rep += 2 * c.kv_heads * c.head_dim // min(tp, c.kv_heads) * n
        if c.bias:  # the row-parallel biases (o_proj, down_proj) are whole on every tp rank
            rep += 2 * c.hidden * n if not c.is_moe else c.hidden * n
    if holds_embedding(m, par, pp_rank):
        bd["embed"] = m.vocab * m.hidden // tp
        if m.positions == "learned":
            bd["positions"] = m.seq_len * m.hidden
            rep += m.seq_len * m.hidden
    if n_stages - 1 in stages:
        bd["norm"] = m.hidden * (2 if m.norm == "layernorm" else 1)
        rep += bd["norm"]
        if has_head(m, par):
            bd["head"] = m.hidden * m.vocab // tp
        if m.mtp_depth:
            bd["mtp"], mrep, mexp = mtp_params_local(m, tp, ep)
            rep += mrep
            bd["experts"] = bd.get("experts", 0) + mexp
            bd["mtp"] -= mexp
    expert = bd.get("experts", 0)
    dense = sum(bd.values()) - expert
    return RankParams(pp_rank, layers, dense, expert, bd, rep)


def all_rank_params(m: ModelConfig, par: ParallelConfig) -> list[RankParams]:
    return [rank_params(m, par, r) for r in range(par.pp)]


def _block_list(m: ModelConfig, par: ParallelConfig, i: int, p: str = ""
                ) -> list[tuple[str, int, bool]]:
    """Block ``i``'s parameters under the prefix ``p`` (default ``layers.{i}.``)."""
    m = layer_cfg(m, i)
    tp = par.tp
    h, d = m.hidden, m.head_dim
    kv_shards = min(tp, m.kv_heads)
    p = p or f"layers.{i}."
    ln = m.norm == "layernorm"
    out = [(p + "input_layernorm.weight", h, False)]
    out += [(p + "input_layernorm.bias", h, False)] if ln else []
    if m.is_mla:
        out += [(p + "self_attn." + name, n, False) for name, n, _ in mla.weights(m, tp)]
    for w, n, cut in (() if m.is_mla else (("q", m.heads, tp), ("k", m.kv_heads, kv_shards),
                                            ("v", m.kv_heads, kv_shards))):
        out.append((p + f"self_attn.{w}_proj.weight", h * n * d // cut, False))
        if m.bias or m.qkv_bias:  # column-parallel: the bias is cut with the output
            out.append((p + f"self_attn.{w}_proj.bias", n * d // cut, False))
    if not m.is_mla:
        out.append((p + "self_attn.o_proj.weight", m.heads * d * h // tp, False))
    if m.bias:  # row-parallel: the bias is whole on every tp rank
        out.append((p + "self_attn.o_proj.bias", h, False))
    if m.qk_norm:  # whole on every tp rank
        out += [(p + "self_attn.q_norm.weight", d, False), (p + "self_attn.k_norm.weight", d,
                                                            False)]
    out.append((p + "post_attention_layernorm.weight", h, False))
    out += [(p + "post_attention_layernorm.bias", h, False)] if ln else []
    if m.is_moe:
        f = m.expert_ffn
        out.append((p + "block_sparse_moe.gate.weight", h * m.experts, False))
        per = m.experts // par.ep
        for e in range(per):  # this rank's experts (the count is what matters)
            q = f"{p}block_sparse_moe.experts.{e}."
            out += [(q + "w1.weight", h * f, True), (q + "w3.weight", h * f, True),
                    (q + "w2.weight", f * h, True)]
        if m.shared_expert:
            q, fs = p + "block_sparse_moe.shared_expert.", m.shared_ffn
            out += [(q + "gate_proj.weight", h * fs // tp, False),
                    (q + "up_proj.weight", h * fs // tp, False),
                    (q + "down_proj.weight", fs * h // tp, False)]
            if m.shared_expert_gate:
                out.append((p + "block_sparse_moe.shared_expert_gate.weight", h, False))
    else:
        for w in (("gate", "up") if m.mlp == "swiglu" else ("up",)):
            out.append((p + f"mlp.{w}_proj.weight", h * m.ffn // tp, False))
            if m.bias:
                out.append((p + f"mlp.{w}_proj.bias", m.ffn // tp, False))
        out.append((p + "mlp.down_proj.weight", m.ffn * h // tp, False))
        if m.bias:
            out.append((p + "mlp.down_proj.bias", h, False))
    return out


def param_list(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0
               ) -> list[tuple[str, int, bool]]:
    """(name, elements on this rank, is_expert) in registration order, virtual stages in order."""
    n = par.pp * max(1, par.virtual_stages)
    st = stage_layers(m, par)
    out: list[tuple[str, int, bool]] = []
    if holds_embedding(m, par, pp_rank):  # registered first (a pipeline stage: from any chunk)
        out.append(("embed_tokens.weight", m.vocab * m.hidden // par.tp, False))
    for k in rank_stages(par, pp_rank):
        if k == 0:
            if m.positions == "learned":  # replicated over tp
                out.append(("embed_positions.weight", m.seq_len * m.hidden, False))
        for i in st[k]:
            out += _block_list(m, par, i)
        if k == n - 1:
            out.append(("norm.weight", m.hidden, False))
            if m.norm == "layernorm":
                out.append(("norm.bias", m.hidden, False))
            if has_head(m, par):
                out.append(("lm_head.weight", m.hidden * m.vocab // par.tp, False))
            for j in range(m.mtp_depth):
                q = f"mtp.{j}."
                out += [(q + "enorm.weight", m.hidden, False), (q + "hnorm.weight", m.hidden,
                                                                False),
                        (q + "eh_proj.weight", 2 * m.hidden * m.hidden, False)]
                out += _block_list(m, par, m.layers + j, q + "block.")
                out.append((q + "norm.weight", m.hidden, False))
    return out


# the linear layers ``--fp8`` runs in fp8, by module name (``fived.parallel.fp8`` swaps them):
# attention, the MLP, the routed and the shared experts; not the embedding, head, router, norms
FP8_LINEARS = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123]"
    r"|block_sparse_moe\.shared_expert\.(gate|up|down)_proj)$")


def fp8_gather(par: ParallelConfig) -> bool:
    """Whether ZeRO all-gathers the fp8 linears' weights in e4m3 (``fived.parallel.data.fp8``):
    where it can (``fived.config.fp8_gather_applies``), unless ``--no-fp8-gather``."""
    return getattr(par, "fp8_gather", True) and fp8_gather_applies(par)


def fp8_weight(name: str) -> bool:
    """A parameter name that is the weight of an fp8 linear (``FP8_LINEARS``)."""
    return name.endswith(".weight") and FP8_LINEARS.search(name[:-len(".weight")]) is not None


@lru_cache(maxsize=65536)  # the search asks for the same names (every expert's) per layout
def block_of(name: str) -> int | None:
    """The block index of a parameter name, None for the root (embedding, norm, head)."""
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def zero3_unit(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0):
    """ZeRO-3's gather unit of a parameter name: its block (an MTP module's block k: L + k;
    −1: the root, i.e. embedding, final norm, head, the MTP modules' norms and eh_proj); with
    pp > 1 its (virtual) stage, the pipeline chunk the executor
    gathers (the embedding's copy on a last stage: that stage's). The engine's buckets
    (``memory._buckets``), its buffer replay and the optimizer's per-bucket parameters
    (``optimizers.opt_buckets``) all cut by it."""
    if par.pp <= 1:  # a block (an MTP module's block k: unit L + k), or the root
        def block(name: str) -> int:
            b = block_of(name)
            if b is None and name.startswith("mtp.") and name.split(".")[2] == "block":
                return m.layers + int(name.split(".")[1])
            return -1 if b is None else b
        return block
    n = par.pp * max(1, par.virtual_stages)
    stage_of = {i: k for k, ids in enumerate(stage_layers(m, par)) for i in ids}
    embed = 0 if 0 in rank_stages(par, pp_rank) else n - 1

    def unit(name: str) -> int:
        b = block_of(name)
        if b is not None:
            return stage_of[b]
        return embed if name.startswith("embed_tokens") else n - 1
    return unit


def alone(m: ModelConfig, par: ParallelConfig, name: str) -> bool:
    """A parameter in a bucket of its own: the embedding's copies of the embedding group
    (``fived.parallel.data.layout.alone``)."""
    return name == "embed_tokens.weight" and embed_copies(m, par) > 1


def ep_destinations_bound(m: ModelConfig, par: ParallelConfig) -> int:
    """The most ep ranks one token's rows reach in a MoE layer: min(k, ep) in general; with
    node-limited routing (M of G contiguous expert groups) M·⌈ep/G⌉ when G and ep divide one
    another (a rank owns G/ep whole groups, or a group spans ep/G ranks). The row dispatch
    (``ep_dispatch = rows``) still sends k rows per token; the token dispatch sends one per
    (token, rank reached), so its bytes are at most this many rows per token
    (``ep_token_traffic``)."""
    n, k = par.ep, m.top_k
    out = min(k, n)
    G = m.route_groups
    if m.node_limited and (G % n == 0 or n % G == 0):
        out = min(out, m.route_top_groups * max(1, n // G))
    return out
