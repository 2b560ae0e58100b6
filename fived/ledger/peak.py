"""The step's peak: what a rank keeps plus what each phase of the step touches at its worst
moment, phase by phase — the number that decides whether a layout fits.

``step_phases`` walks one step of one pipeline rank in the order the runtime runs it: the
rank's compute actions from its schedule (``fived.schedules``; without pp, F and B of each
micro-batch), then the gradient reduction, the clip and the optimizer step. At each phase

    live = kept + saved + Σ transients

* **kept**: the model states (``memory.model_states``: params, grads, master, optimizer)
  and the step's inputs (token ids, targets, positions: ``step_input_bytes``);
* **saved**: the activations of every micro-batch whose forward has run on one of the rank's
  stages and whose backward has not yet released them (``memory.stage_activation_bytes`` per
  stage, the schedule replayed as in ``memory.inflight_by_stage``); a forward's phase already
  holds its own micro-batch, a backward's still does;
* **transients**, each by name, sized from the layout and the runtime code that makes it:

  ========================  ==============================================================
  ``loss_forward``          the last stage's F, beyond what the loss saves: an fp32 copy of
                            the logits (bf16/fp16; tokens · V · 4), or under tp the
                            vocab-parallel loss's fp32 shifted logits and exponentials
                            (2 · tokens · V/tp · 4)
  ``tp_regions``            tp without SP, F of a stage before the last: the previous
                            column region's input and the new one's (2 · tokens · h · e)
  ``loss_backward``         the last stage's B: the fp32 exponentials and the fp32 gradient
                            of the logits (2 · tokens · V/tp · 4) and, in bf16/fp16, that
                            gradient cast to the compute dtype (+ e · tokens · V/tp), while
                            every saved activation is still alive
  ``head_backward``         the last stage's B, after the loss: the logits' gradient, the
                            head's weight gradient before it joins its bucket (V/tp · h · e)
                            and the input gradient with its reduction's buffer
  ``block_backward``        every B: the first block's backward, its MLP working set: the
                            block output's gradient (tokens · h/sp · e) and four
                            tokens · ffn/tp tensors in the compute dtype (the down
                            projection's input gradient, SiLU recomputed, its backward, the
                            up gradient: ``fived.model.layers.SwiGLU``); GELU: three; MoE:
                            top_k · expert_ffn per token in place of ffn/tp; fp8
                            (tensorwise, blockwise; dense): + tokens · ffn/tp · e less the
                            down projection's fp8 input, the part of it its backward did
                            not free; or, where larger (h wide against the tokens), the
                            first of gate/up at its weight gradient: its input gradient
                            (tokens · h · e), its saved input's and its output gradient's
                            casts, dW in fp32 and the weight's dtype (h · ffn/tp · (4 + e)),
                            less the down projection's saved input
  ``expert_stack``,         grouped experts (``memory.grouped_experts``), a MoE stage's F:
  ``experts_forward``       the stacked local weights (``memory.expert_stack_bytes``) and
                            SiLU(G) beside the saved G and U (r · f_e · e, r the rank's
                            routed rows, ``experts_rows``); the all-to-all buffers are idle
  ``moe_combine``           a MoE stage's F, its last MoE layer's combine: the un-permuted
                            slots and their weighted product (2 · r · h · e, r the rank's
                            routed rows) beside the saved expert outputs (``moe._Combine``);
                            its B, the first MoE layer's combine backward: the output
                            gradient, dy, the rebuilt slots and the zeros they are copied
                            into (3 · r · h · e) and the shared expert's input gradient, its
                            saves freed, no SP gather in flight
  ``experts_backward``      grouped experts, a MoE stage's B: the stack made again, the
                            three weight gradients as stacks (3 · E/ep · f_e · h · e), three
                            r · f_e gradients and two r · h ones
                            (``grouped.GroupedSwiGLU.backward``) beside the last column
                            region's input; no all-to-all buffer nor received gradient
  ``zb_outputs``,           a split backward (ZB-H1, ZB-V, DualPipe-V; ``split_backward``):
  ``zb_grads``,             the linear outputs the split forward's records keep beyond
  ``zb_stash``,             autograd's saves (F to B), the dL/dy each B makes, what every B
  ``zb_weight_grads``       leaves its W once autograd's saves are freed (inputs, outputs,
                            their gradients, per block shape — MLA's projections, the shared
                            expert, the experts' loop: ``zb_parts``) and the W's weight
                            gradients, all
                            made before any is accumulated (``zb_weight_grads_bytes``); a B
                            run with its own W as one backward (``memory.fused_backwards``)
                            keeps nothing
  ``pp_receives``           pp, every F, B and W: the receives posted ahead (one per peer)
                            and those arrived before they are wanted
                            (``memory.receives_held``, a replay of the executor's ``_P2P``),
                            one activation each (tokens · h/sp · e)
  ``mtp_backward``          multi-token prediction, the last stage's block, expert and
                            module-norm moments: the modules' head weight gradient waiting
                            for the trunk's head, then (without pp) their embedding gradient
                            waiting for the trunk's embedding (V/tp · h · e,
                            ``mtp_backward_bytes``)
  ``mtp_norm``              multi-token prediction, the last stage's B at the last module's
                            output norm backward: the head's input gradient and the norm's
                            fp32 working set (``mtp_norm_backward_bytes``)
  ``fp8_down_backward``     fp8, a dense first block's down projection at its dgrad's cast:
                            its saved input held, the output gradient (under SP gathered and
                            made contiguous: 2 · tokens · h · e), rowwise's or blockwise's
                            column-wise cast of that input, the product in fp32 and in the
                            compute dtype (tokens · ffn/tp · (4 + e)) — or, where larger, at
                            its weight gradient: dx kept (tokens · ffn/tp · e), g's
                            transposed cast, dW in fp32 and the weight's dtype
                            (h · ffn/tp · (4 + e)); ZeRO-3 without pp: the block's unit
                            gathered, its gradient bucket not yet allocated, and each later
                            dense block's with the buckets of the blocks after it held;
                            ZeRO-2: the buckets the head's gradients opened
  ``norm_backward``         ``--recompute full``, a dense first block: the re-run block's
                            second norm at its backward, its MLP's saves freed: the block
                            output's and the MLP's input gradients (2 · tokens · h/sp · e),
                            the norm's fp32 working set (20 · tokens · h/sp) and its weight
                            gradient (h · e); under ZeRO-2/3 each later dense block's too
  ``ring_backward``         ``--recompute full`` under the cp2 ring (no document masks): the
                            re-run core's ring backward at its second step, the MLP's and
                            second norm's saves freed: the block's and the core's output
                            gradients, 3 · A + 3 · K of fp32 working set (A = tokens · hq · 4,
                            K = 2 · tokens · kv · d · 4) and the kernel's call (cp rank 0:
                            4.5 · A + K; rank 1: 3 · A + K / 2)
  ``recompute_block``       ``--recompute full``, every B: the re-materialised block's saved
                            bytes less its input, which the checkpoint holds already
                            (``memory.recompute_layer_bytes``)
  ``grad_recv``             pp, every B but the last stage's: the received output gradient
                            (tokens · h/sp · e)
  ``sp_gather``, ``cp_ring``, ``ep_a2a``  F and B: the collectives' in-flight buffers
                            (``memory.comm_buffers``); the cp ring's (Ulysses') and the
                            all-to-all's are idle at the loss's moments and the cp one at the
                            MLP's backward (they run inside the attention core, the MoE layer)
  ``mlp_forward``,          a stage's F before the last, without tp, at its last block:
  ``cp_ring`` (F)           SiLU(G) beside the saved G and U (dense SwiGLU, tokens · ffn · e),
                            or the cp exchange's buffers at its attention less the block's MLP
                            saves, not made yet (``cp_ring − mlp``), whichever is larger
  ``zero_buffers``          ZeRO-2/3, every B and the reduction: the full-gradient buckets
                            and gathered units at each moment of the engine's replay
                            (``memory.zero_moments``: the loss, the head's gradient, each
                            block's MLP end — every later dense block's MLP backward is a
                            moment of its own, the blocks before it freed); ZeRO-3's gathered
                            units in every F too (the root at the loss, the last block at its
                            combine, the last one prefetched at the block before)
  ``experts_backward``      the experts' loop (``expert_matmul = loop``), a MoE stage's B at
  (loop)                    its last MoE layer's first expert's end: the block output's and
                            the shared expert's input gradients, the combine's gradient of
                            the rows, the expert's last weight gradient and its rows' input
                            gradients; the shared expert's, the combine's and the expert's
                            own saves freed
  ``tp_last_input``         tp, after the last forward: the last column region's input
                            (tokens · h/sp · e; under SP also its gathered copy,
                            ``sp_gather``), referenced until the next forward; at the last
                            stage's first-block moments (one chunk a rank) the head's region
                            is done: its input (the final norm's output) held, no SP copy;
                            fp8 under full recompute at tp: the re-run gate/up region's input
                            and under SP its gathered copy (``rerun_region``), in place of an
                            SP gather at the block's moments
  ``clip``                  one float64 chunk of the largest gradient piece
                            (8 · min(piece, ``SQ_CHUNK``), ``fived.optim.clip``)
  ``optimizer``             fused AdamW works in place; with gradients kept in bf16 the
                            step upcasts each owned gradient (4 bytes per owned element)
  ``fp8_gather``            ZeRO-1/2's fp8 gather after the step: Σ S_b (every fp8 bucket's
                            e4m3 shard, held until the gathers are waited for) + the last
                            cast's largest piece in the compute dtype (P · min(widest fp8
                            weight, S_b)) and its new scales (4 · A_b)
                            (``fp8_publish_bytes``)
  ========================  ==============================================================

A moment may free saved bytes (the loss's saves at the blocks' backward, the saves of the
blocks already done, the MoE layer's): its ``saved_freed`` key (``FREED``, ≤ 0) lowers the
phase's ``saved``.

What is not modelled (the dry run's ``ledger --check`` gap says how much it matters): a
forward's own working set under tp (the regions' inputs are counted instead), the cp ring's
backward working set inside the attention core (the MLP's backward before it holds more), the
build (a step's peak is what is compared: the dry
run builds the whole plain model on fake tensors before cutting it, which a real run does
not), the attention kernel's
own workspace, autograd's order of frees inside a block (the block term is its largest set,
not a replay of every op).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..config import ModelConfig, ParallelConfig
from . import mla
from .memory import (
    EAGER,
    ActivationOptions,
    RankMemory,
    _state_key,
    act_bytes,
    arrival_runs,
    block_input_bytes,
    buckets,
    candidate_ranks,
    comm_buffers,
    embed_bucket,
    fp8_column_cast_bytes,
    fp8_copy_bytes,
    fused_backwards,
    grad_bytes,
    grouped_experts,
    layer_activations,
    model_states,
    mtp_activations,
    param_bytes,
    rank_memory,
    receives_held,
    recompute_layer_bytes,
    releases_at,
    schedule_actions,
    selective_layer,
    stage_activation_bytes,
    stage_extra_activations,
    zero_moments,
)
from .params import (
    block_params,
    fp8_gather,
    fp8_weight,
    layer_cfg,
    layer_kinds,
    param_list,
    rank_stages,
    stage_layers,
)

_KINDS = ("mla_down", "mla_norm", "mla_up", "router", "experts", "shared_expert")  # kinds
# of ``block_params`` that sum several weights: ``_clip_bytes`` takes their weights one by one
SQ_CHUNK = 1 << 18  # fived.optim.clip.SQ_CHUNK (the ledger imports no torch)
KEPT = ("params", "grads", "master", "optimizer")
# the collectives' buffers idle at the loss's moments (the last stage's loss forward, the
# loss's and the head's backward): the blocks' all-to-all and the cp ring or Ulysses exchange
LOSS_IDLE = ("ep_a2a", "cp_ring")
FREED = "saved_freed"  # a moment's key (≤ 0): saved bytes already freed there (the Phase's
# ``saved`` is what is still held)


@dataclass(frozen=True)
class Phase:
    name: str  # "F mb s", "B mb s", "W mb s", "reduce", "clip", "optimizer"
    kept: float
    saved: float
    transients: dict[str, float] = field(default_factory=dict)

    @property
    def transient(self) -> float:
        return sum(self.transients.values())

    @property
    def total(self) -> float:
        return self.kept + self.saved + self.transient

    @property
    def largest(self) -> str:
        """The transient that weighs most here ('' when there is none)."""
        t = {k: v for k, v in self.transients.items() if v}
        return max(t, key=t.get) if t else ""

    def as_dict(self) -> dict:
        return {"name": self.name, "kept": self.kept, "saved": self.saved,
                "transients": self.transients, "total": self.total}


def block_backward_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> float:
    """The first block's backward at its worst moment (SwiGLU's backward, as the trace shows
    it): the block output's gradient and three ffn-wide tensors — the down projection's input
    gradient, SiLU recomputed, and the up gradient being made (GELU: two) — or, where the
    hidden size exceeds twice the micro-batch's tokens, the down projection's own backward:
    its input gradient and its weight gradient before it is added into its bucket."""
    e = act_bytes(par)
    tokens = micro_batch * m.seq_len / par.cp
    sp = par.sequence_parallel and par.tp > 1
    grad_out = tokens * m.hidden * e / (par.tp if sp else 1)
    width = 3 if m.mlp == "swiglu" else 2
    if m.is_moe:
        return grad_out + tokens * m.top_k * width * m.expert_ffn * e / (par.tp if sp else 1)
    # or, when a weight outweighs the tokens' rows (h > 2 · tokens), the down projection's
    # backward: its input gradient (tokens · ffn/tp) and its weight gradient (ffn/tp · h)
    # before it joins its bucket, its saved input not yet freed
    rows = max(width * tokens, tokens + m.hidden)
    # the three ffn-wide tensors stand where the down projection's saved input was, freed by
    # its backward; an fp8 linear saved it as fp8 (tensorwise, blockwise), so only that much
    # left: the rest of the compute-dtype width is added back
    f = m.ffn / par.tp
    recipe = getattr(par, "fp8", "none")
    fp8_input = (tokens * f * e - fp8_copy_bytes(tokens, f, recipe)
                 if recipe in ("tensorwise", "blockwise") else 0.0)
    swiglu = grad_out + rows * m.ffn * e / par.tp + fp8_input
    if recipe == "none" or m.mlp != "swiglu":
        return swiglu
    # fp8: the first of gate/up to run its backward, at its weight gradient, where the
    # hidden size is wide against the tokens: its input gradient (tokens · h, the gathered
    # sequence under SP), the column-wise cast of its saved input (rowwise, blockwise), the
    # transposed cast of its output gradient, dW in fp32 and in the weight's dtype; the
    # down projection's saved input and the gate/up outputs freed (the gate/up output
    # gradients stand where the outputs were)
    h = m.hidden
    x_cast = (fp8_column_cast_bytes(tokens, h, recipe) if recipe in ("rowwise", "blockwise")
              else 0.0)
    g_cast = fp8_column_cast_bytes(tokens, f, recipe)
    down_input = (fp8_copy_bytes(tokens, f, recipe) if recipe in ("tensorwise", "blockwise")
                  else tokens * f * e)
    column = grad_out + tokens * h * e + x_cast + g_cast + f * h * (4 + e) - down_input
    return max(swiglu, column)


SPLIT_SCHEDULES = ("zb-h1", "zb-v", "dualpipe-v")  # schedules whose backward is B then W


def split_backward(par: ParallelConfig) -> bool:
    """Whether the rank's backwards are split into B and W (``pipeline.runtime``: not under
    full recompute, where every B is the whole backward)."""
    return par.pp > 1 and par.schedule in SPLIT_SCHEDULES and par.recompute != "full"


def _split_widths(m: ModelConfig, par: ParallelConfig
                  ) -> tuple[float, float, float, float, float]:
    """Per token of the rank's micro-batch and per block of shape ``m`` (``layer_kinds``):
    the widths the split forward's records keep — (inputs, outputs autograd would not save,
    outputs autograd saves until B, output gradients) — and the recorded weights' elements.
    Only linears that run ``F.linear`` with grad enabled are split (``runtime._SplitLinear``):
    the row-parallel ones (o, w2) and the replicated ones (MLA's down-projections, on the
    sequence shard under SP) always; the column ones (q, k, v, MLA's up-projections, w1, w3,
    the head) only without tp, or under tp without SP and overlap — else they run inside
    ``tensor._ColumnMatmul`` and their B makes their weight gradients. A MoE block's router
    and grouped experts (``memory.grouped_experts``) run outside ``F.linear`` (their B makes
    their weight gradients); the experts' loop (fp32, ``expert_matmul = loop``) runs one
    SwiGLU per expert, split; the shared expert is a SwiGLU of width ``shared_ffn``."""
    tp, h = par.tp, m.hidden
    cols = tp == 1 or not (par.sequence_parallel or par.overlap)
    shard = tp if par.sequence_parallel and tp > 1 else 1
    if m.is_moe:
        f = m.shared_ffn / tp if m.shared_expert else 0.0
    else:
        f = m.ffn / tp
    mlp = f > 0
    x = f  # w2's input (SwiGLU's product)
    y = h if mlp else 0.0  # w2's output, before its reduction
    kept = 0.0
    dy = h if mlp else 0.0
    w = f * h
    if cols and mlp:
        x += h  # the norm's output (w1, w3 share it)
        kept += 2 * f  # w1's, w3's outputs: saved by SwiGLU until B, then the records' alone
        dy += 2 * f
        w += 2 * h * f
    if m.is_moe and not grouped_experts(m, par):  # the experts' loop: nn.Linear per expert
        # over its rows (tokens · top_k / shard on the rank, uniform routing): the rows and
        # SwiGLU's product in, w2's outputs (the combine keeps their concatenation), w1's and
        # w3's outputs saved by SwiGLU until B, the three gradients
        k, fe = m.top_k / shard, m.expert_ffn
        x += k * (h + fe)
        y += k * h
        kept += 2 * k * fe
        dy += k * (h + 2 * fe)
        w += m.experts // par.ep * 3 * fe * h
    if m.is_mla:
        H, rq, rkv, dr = m.heads / tp, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
        dq, up_kv = m.qk_head_dim, m.qk_nope_head_dim + m.v_head_dim
        o_in = H * m.v_head_dim  # the core's output (or o_proj's copy of the cut one)
        x += h / shard + o_in  # the norm's output (the down-projections'), o_proj's input
        y += h  # o_proj's output
        dy += h
        w += o_in * h
        # the down-projections: outputs the latent norms save (until B), their gradients
        down = (rq + rkv + dr) / shard
        kept += down
        dy += down
        w += h * (rq + rkv + dr)
        if cols:  # the up-projections (or q_proj): the latents' norm outputs in, q and k/v out
            q_in = rq if rq else 0.0  # q_proj reads the block norm's output, counted above
            x += q_in + rkv
            y += H * (dq + up_kv)
            dy += H * (dq + up_kv)
            w += (rq if rq else h) * H * dq + rkv * H * up_kv
        return x, y, kept, dy, w
    d = m.head_dim
    q, kv = m.heads * d / tp, m.kv_heads * d / min(tp, m.kv_heads)
    x += q  # o's input (the attention output)
    y += h  # o's output, before its reduction
    dy += h
    w += q * h
    if cols:
        x += h  # the norm's output (q, k, v share it)
        y += q + 2 * kv  # q, k, v before RoPE
        dy += q + 2 * kv
        w += h * (q + 2 * kv)
    return x, y, kept, dy, w


def _head_split(m: ModelConfig, par: ParallelConfig) -> bool:
    """Whether the head is a split linear (it is a column layer: ``_split_widths``)."""
    return par.tp == 1 or not (par.sequence_parallel or par.overlap)


def _stage_widths(m: ModelConfig, par: ParallelConfig, stage: int
                  ) -> tuple[float, float, float, float, float]:
    """``_split_widths`` summed over the stage's blocks (dense and MoE shapes)."""
    out = [0.0] * 5
    for c, n in layer_kinds(m, stage_layers(m, par)[stage]):
        for i, v in enumerate(_split_widths(c, par)):
            out[i] += v * n
    return out[0], out[1], out[2], out[3], out[4]


def zb_parts(m: ModelConfig, par: ParallelConfig, micro_batch: int, stage: int
             ) -> tuple[float, float, float]:
    """(outputs, gradients, stash) of a split stage, one micro-batch, in bytes: the linear
    outputs its records keep that autograd would not save (held from F to B), the dL/dy its B
    accumulates into them, and all its W waits for once B has freed autograd's saves — each
    recorded input, output and output gradient (``_split_widths``), the head's final-norm
    output, logits and their gradient on the last stage when the head is split."""
    e = act_bytes(par)
    tokens = micro_batch * m.seq_len / par.cp
    x, y, kept, dy, _ = _stage_widths(m, par, stage)
    outputs, grads = tokens * e * y, tokens * e * dy
    stash = tokens * e * (x + y + kept + dy)
    if stage == par.pp * max(1, par.virtual_stages) - 1 and _head_split(m, par):
        v = m.vocab / par.tp
        grads += tokens * e * v
        stash += tokens * e * (m.hidden + 2 * v)
    return outputs, grads, stash


def zb_weight_grads_bytes(m: ModelConfig, par: ParallelConfig, stage: int) -> float:
    """A W's weight gradients, all made before any is accumulated (``runtime._weight_grads``),
    in the compute dtype: the stage's recorded linear weights on the rank."""
    out = _stage_widths(m, par, stage)[4]
    if stage == par.pp * max(1, par.virtual_stages) - 1 and _head_split(m, par):
        out += m.vocab / par.tp * m.hidden
    return out * act_bytes(par)


def experts_rows(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> float:
    """The rows a rank's experts run per MoE layer and micro-batch under uniform routing:
    its tokens (÷ tp under SP) times top_k — what it sends, it receives."""
    sp = par.tp if par.sequence_parallel and par.tp > 1 else 1
    return micro_batch * m.seq_len / par.cp * m.top_k / sp


def experts_backward_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> float:
    """A MoE layer's grouped experts at the end of their backward (``fived.model.grouped.
    GroupedSwiGLU.backward``), uniform routing: over the rank's r = tokens · top_k / sp rows,
    the three weight gradients as stacks (3 · E/ep · f_e · h · e, before they are split into
    their buckets), the down projection's input gradient, SiLU's backward and the up gradient
    (3 · r · f_e · e), the rows' input gradient and the combine's gradient of the rows
    (2 · r · h · e)."""
    e = act_bytes(par)
    rows = experts_rows(m, par, micro_batch)
    weights = m.experts // par.ep * m.expert_ffn * m.hidden * e
    return 3 * weights + 3 * rows * m.expert_ffn * e + 2 * rows * m.hidden * e


def mtp_backward_bytes(m: ModelConfig, par: ParallelConfig) -> float:
    """Multi-token prediction (``fived.model.mtp``): the D modules ran last in the forward, so
    autograd takes their backward first. Their use of the shared head leaves its weight
    gradient (V/tp · h) waiting for the trunk's head backward, through the modules' norm and
    blocks; without pp their embedding lookups' weight gradient (the D lookups summed in one
    buffer, V/tp · h) then waits for the trunk's lookup, whose backward is the step's last,
    through the trunk's blocks (under pp the last stage's embedding copy is read by the
    modules alone). One V/tp · h buffer at the blocks' moments, either way."""
    if not m.mtp_depth:
        return 0.0
    return m.vocab / par.tp * m.hidden * act_bytes(par)


def mtp_norm_backward_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> float:
    """The last module's output norm's backward (``layers._RMSNorm``), after its head's: the
    head's input gradient (tokens · h · e; under SP reduce-scattered to its shard), and the
    norm's fp32 working set — x̂, the scaled gradient and the two products of dx's formula
    (4 · tokens · h/sp · 4) — with its weight gradient (4h); the head's weight gradient held
    beside it (``mtp_backward_bytes``)."""
    if not m.mtp_depth:
        return 0.0
    tokens = micro_batch * m.seq_len / par.cp
    sp = par.tp if par.sequence_parallel and par.tp > 1 else 1
    return tokens * m.hidden * act_bytes(par) / sp + 16 * tokens * m.hidden / sp + 4 * m.hidden


def step_input_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> float:
    """The step's token ids and targets (int64, every micro-batch of the rank's batch rows,
    its sequence shard) and the positions (int64), held through the step."""
    s_local = m.seq_len / par.cp
    return 2 * 8 * micro_batch * par.micro_batches * s_local + 8 * s_local


def loss_forward_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> float:
    """The loss's forward beyond what it saves: an fp32 copy of the logits in bf16/fp16, and
    under tp the vocab-parallel loss's shifted logits (tokens · V/tp · 4 each)."""
    tokens = micro_batch * m.seq_len / par.cp
    return (2 if par.tp > 1 else int(act_bytes(par) != 4)) * tokens * m.vocab / par.tp * 4


def loss_backward_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> float:
    """The loss's backward: the fp32 exponentials and the fp32 gradient of the logits
    (tokens · V/tp each), and in bf16/fp16 the gradient cast to the compute dtype."""
    tokens = micro_batch * m.seq_len / par.cp
    e = act_bytes(par)
    return tokens * m.vocab / par.tp * (8 + (e if e != 4 else 0))


def clip_bytes(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> float:
    """One float64 copy of the largest chunk of a gradient piece the norm reads (a piece is
    one parameter's part of the rank's shard)."""
    return _clip_bytes(m, _state_key(par), pp_rank)


@lru_cache(maxsize=8192)
def _clip_bytes(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> float:
    stages = rank_stages(par, pp_rank)
    ends = (0, par.pp * max(1, par.virtual_stages) - 1)  # the embedding's and the head's
    cut = [m.vocab * m.hidden / par.tp] if par.pp == 1 or set(ends) & set(stages) else []
    own = embed_bucket(m, par, pp_rank) if par.zero >= 1 else None
    if own is not None:  # the embedding in its own bucket (the embedding group): its piece
        # is at most that bucket's shard, the others' at most the other buckets' shards
        rest = [b for b in buckets(m, par, pp_rank) if b is not own]
        embed = min(m.vocab * m.hidden / par.tp, own.shard)
        others = _clip_others(m, par, stages)
        largest = max(embed, min(others, max((b.shard for b in rest), default=0)))
        return 8.0 * min(largest, SQ_CHUNK)
    largest = max(cut + [_clip_others(m, par, stages)])
    if par.zero >= 1:
        largest = min(largest, max((b.shard for b in buckets(m, par, pp_rank)), default=0))
    return 8.0 * min(largest, SQ_CHUNK)


def _clip_others(m: ModelConfig, par: ParallelConfig, stages) -> float:
    """The largest block weight of the rank's stages (elements on the rank)."""
    cut = [0.0]
    layers = [i for st in stages for i in stage_layers(m, par)[st]]
    for c, _ in layer_kinds(m, layers):
        cut += [v / par.tp for k, v in block_params(c).items() if k not in _KINDS]
        if c.is_mla:  # one piece per weight, not per kind
            cut += [n for _, n, _ in mla.weights(c, par.tp)]
        if c.is_moe:  # one expert's weight, the router, one shared-expert weight
            cut += [c.expert_ffn * c.hidden, c.experts * c.hidden]
            if c.shared_expert:
                cut.append(c.shared_ffn * c.hidden / par.tp)
    return max(cut)


def fp8_publish_bytes(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0) -> float:
    """ZeRO-1/2's fp8 gather after the step (``fived.parallel.data.zero12``): every fp8
    bucket's e4m3 shard (1 byte per owned element) is held until all the gathers are waited
    for, and while the last is cast, its largest piece divided by its scale in the compute
    dtype (param bytes × the largest fp8 weight on the rank, at most a shard) beside the
    bucket's new scales (4 per tile amax, the old ones still provided); 0 elsewhere."""
    if par.zero not in (1, 2) or not fp8_gather(par):
        return 0.0
    f8 = [b for b in buckets(m, par, pp_rank) if b.gathered_bytes_per_element]
    if not f8:
        return 0.0
    widest = max(k for n, k, _ in param_list(m, par, pp_rank) if fp8_weight(n))
    return float(sum(b.shard for b in f8) + max(
        param_bytes(par) * min(widest, b.shard) + 4 * b.fp8_amax for b in f8))


def step_phases(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
                opts: ActivationOptions = EAGER, optimizer: str = "adamw",
                dense_index: int = 0, expert_index: int = 0, cp_rank: int = 0) -> list[Phase]:
    """Every phase of one step of pipeline rank ``pp_rank``, in the runtime's order;
    ``cp_rank``: the rank's place on the cp ring (0, the default, holds the ring's largest
    backward working set)."""
    states = model_states(m, par, pp_rank, dense_index, expert_index, optimizer)
    kept = float(sum(states.get(k, 0) for k in KEPT)) + step_input_bytes(m, par, micro_batch)
    stages = rank_stages(par, pp_rank)
    n_stages = par.pp * max(1, par.virtual_stages)
    per = {s: stage_activation_bytes(m, par, micro_batch, s, opts) for s in stages}
    split = split_backward(par)
    fused = fused_backwards(par, pp_rank) if split else frozenset()
    zb = {s: zb_parts(m, par, micro_batch, s) for s in stages} if split else {}
    e = act_bytes(par)
    tokens = micro_batch * m.seq_len / par.cp
    sp = par.sequence_parallel and par.tp > 1
    cb = comm_buffers(m, par, micro_batch, pp_rank)
    zero = cb.get("zero_full_grads", 0.0) + cb.get("zero3_gather", 0.0)
    moments = zero_moments(m, par, pp_rank) if zero else None
    inflight = {k: cb[k] for k in ("sp_gather", "cp_ring", "ep_a2a") if k in cb}
    grouped = grouped_experts(m, par)
    recompute = 0.0
    if par.recompute == "full":
        recompute = max((recompute_layer_bytes(c, par, micro_batch, opts)
                         for s in stages for c, n in layer_kinds(m, stage_layers(m, par)[s])
                         if n), default=0.0)
    free = "B" if split else releases_at(par)  # split: B frees autograd's saves
    live = dict.fromkeys(stages, 0)
    saved = 0.0
    out: list[Phase] = []
    def zero_at(which: int, nth: int) -> float:
        """ZeRO's buffers at a backward's start (3), at its first gradient (5), at its first
        block's first gradient (0) or once that block's MLP gradients are in (4)."""
        if not zero:
            return 0.0
        if moments is None:
            return zero
        seq = moments[which]
        return float(seq[min(nth, len(seq) - 1) if nth >= 0 else -1])

    worst: dict[tuple, dict[str, float]] = {}  # the same stage, moment and buffers: once

    def backward_moment(t: dict[str, float], last: bool, s: int, nth: int, held: bool = False
                        ) -> dict[str, float]:
        """The B's worst moment: the loss's backward (last stage: every saved tensor alive,
        no gradient arrived) or the first block's (the loss's saved tensors gone)."""
        key = (s, nth, held, tuple(t.items()))
        if key not in worst:
            worst[key] = _backward_moment(t, last, s, nth, held)
        return dict(worst[key])

    def _backward_moment(t: dict[str, float], last: bool, s: int, nth: int, held: bool
                         ) -> dict[str, float]:
        """``held``: a split B whose records keep the head's input and logits until its W
        (they are not freed after the loss's backward) and its dL/dlogits."""
        block = block_backward_bytes(m, par, micro_batch) if split_layers[s] else 0
        # the cp exchange runs inside the attention core only: idle at the MLP's backward;
        # on the last stage (one chunk a rank) the last column region is the head's, its
        # backward done: no SP copy held, its input (the final norm's output) referred to
        # until the next forward (``tensor.Columns``)
        head_last = (last and par.tp > 1 and max(1, par.virtual_stages) == 1
                     and not recompute)  # (a re-run block opens its own regions)
        blk = dict({k: v for k, v in t.items()
                    if k != "cp_ring" and not (head_last and k == "sp_gather")},
                   block_backward=block)
        if recompute and par.tp > 1 and recipe != "none":  # no SP gather in flight: the
            blk.pop("sp_gather", None)  # fp8 columns gathered in the re-run forward
            if rerun_region:
                blk["tp_last_input"] = rerun_region
        if not last and par.pp > 1:  # the received gradient is the block output's gradient
            blk["grad_recv"] = tokens * m.hidden * e / (par.tp if sp else 1)
            blk["block_backward"] = max(0.0, block - blk["grad_recv"])
        if recompute:
            blk["recompute_block"] = recompute
        if zero:
            blk["zero_buffers"] = zero_at(4, nth)  # the first block's MLP gradients in
        down = down_moment(blk, s, nth)
        norm = norm_moment(blk, s)
        ring = ring_moment(blk, s)
        moe = experts_moment(t, s, blk)
        comb = combine_moment(s, blk)
        if comb and zero:  # the shared expert's gradients in, not yet the experts'
            comb["zero_buffers"] = zero_at(0, nth)
        if moe and m.is_moe_layer(split_layers[s][-1]):  # the first block to run its
            blk = {}  # backward is a MoE one: its moments are the experts' and the combine's
        if not last:
            return max((blk, down, norm, ring, moe, comb, later_blocks(blk, s, nth, 0.0)),
                       key=lambda d: sum(d.values()))
        mtp = mtp_backward_bytes(m, par)  # the modules' head (or embedding) gradient
        for d in (blk, moe, comb):
            if mtp and d:
                d["mtp_backward"] = mtp
        gone = sum(stage_extra_activations(m, par, micro_batch, s == 0, True, opts)[k]
                   for k in ("final_norm", "logits"))
        if head_last and gone and blk:  # the final norm's output, still referred to
            blk["tp_last_input"] = tokens * m.hidden * e / (par.tp if sp else 1)
            if down:
                down["tp_last_input"] = blk["tp_last_input"]
        for d in (down, norm, ring):
            if gone and d:
                d[FREED] = -gone
        if held and _head_split(m, par):
            gone = 0.0
            for d in (blk, moe):
                if d:
                    d["zb_grads"] = tokens * e * m.vocab / par.tp  # the logits' gradient
        if gone and blk:  # the loss's saved logits and final norm, freed before the blocks'
            blk[FREED] = -gone  # backward
        idle = {k: v for k, v in t.items() if k not in LOSS_IDLE}  # no block runs there
        loss = dict(idle, loss_backward=loss_backward_bytes(m, par, micro_batch))
        if zero:
            loss["zero_buffers"] = zero_at(3, nth)
        # the head's backward: the logits' gradient (compute dtype), the head's weight
        # gradient before it is added into its bucket (V/tp · h), the input gradient (its tp
        # all-reduce runs in place) and under SP the input re-gathered for the weight
        # gradient (``tensor._ColumnMatmul``); the loss's saved logits already freed
        logits = stage_extra_activations(m, par, micro_batch, s == 0, True, opts)["logits"]
        head = dict(idle, head_backward=max(0.0, tokens * m.vocab / par.tp * e
                                         + m.vocab * m.hidden / par.tp * e
                                         + (2 if sp else 1) * tokens * m.hidden * e - logits))
        if zero:
            head["zero_buffers"] = zero_at(5, nth)  # the head's gradient in, no block's
        norm_mtp = {}
        if m.mtp_depth:  # the last module's norm, its head's weight gradient held
            norm_mtp = dict(idle, mtp_backward=mtp,
                            mtp_norm=mtp_norm_backward_bytes(m, par, micro_batch))
            if gone:  # the module's logits freed, its norm's saves in use
                norm_mtp[FREED] = -logits
            if zero:
                norm_mtp["zero_buffers"] = zero_at(5, nth)
        if moe:
            if gone:
                moe[FREED] = moe.get(FREED, 0.0) - gone
        if comb:
            if gone:
                comb[FREED] = comb.get(FREED, 0.0) - gone
        return max((loss, head, norm_mtp, blk, down, norm, ring, moe, comb,
                    later_blocks(blk, s, nth, gone)), key=lambda d: sum(d.values()))

    split_layers = stage_layers(m, par)
    experts_on = {s: any(m.is_moe_layer(i) for i in split_layers[s]) for s in stages}

    def has_experts(s: int) -> bool:
        return experts_on[s]

    def combine_moment(s: int, blk: dict[str, float]) -> dict[str, float]:
        """A MoE stage's B at its last MoE layer's combine backward ({} without MoE layers;
        ``moe._Combine.backward``): the output gradient, dy and the rebuilt slots with the
        zeros they are copied into (3 · r · h · e: ``_Combine.slots`` is an out-of-place
        ``index_copy``) beside the shared expert's input gradient, which waits to be summed
        with the experts' (tokens · h/sp · e), the shared expert's saves freed (its backward
        ran first); no SP gather is in flight there."""
        if not has_experts(s):
            return {}
        comb = {k: blk[k] for k in ("recompute_block", "zero_buffers", "zb_stash",
                                    "zb_outputs", "pp_receives", "grad_recv", "mtp_backward",
                                    "zb_grads") if k in blk}
        grad_out = tokens * m.hidden * e / (par.tp if sp else 1)
        comb["moe_combine"] = (grad_out * (0 if "grad_recv" in comb else 1)
                               + 3 * experts_rows(m, par, micro_batch) * m.hidden * e
                               + (grad_out if m.shared_expert else 0.0))
        if shared_saves:  # the shared expert's backward ran first: its saves are freed
            comb[FREED] = -shared_saves
        return comb

    def experts_moment(t: dict[str, float], s: int, blk: dict[str, float]
                       ) -> dict[str, float]:
        """A MoE stage's B at its experts' backward ({} without MoE layers): the stacked
        weights, their three gradients, the rows' three ffn-wide gradients and two hidden-wide
        ones (``experts_backward_bytes``), beside the last column region's input (tp); the
        all-to-all buffers and the received gradient are gone by then."""
        if not has_experts(s):
            return {}
        if not grouped:
            return loop_moment(blk)
        moe = {k: blk[k] for k in ("recompute_block", "zero_buffers", "zb_stash",
                                   "zb_outputs", "pp_receives") if k in blk}
        moe["expert_stack"] = cb.get("expert_stack", 0.0)
        if par.tp > 1:
            moe["tp_last_input"] = tokens * m.hidden * e
        moe["experts_backward"] = experts_backward_bytes(m, par, micro_batch)
        return moe

    def later_blocks(blk: dict[str, float], s: int, nth: int, gone: float
                     ) -> dict[str, float]:
        """ZeRO-2/3 (replayed; without MTP or a split backward): the MLP backward of each
        later dense block of the stage, its gradient buckets allocated by then
        (``zero_moments``' ninth), the saves of the blocks before it (and the loss's) freed;
        the worst of them ({} when none is later)."""
        if not (zero and moments is not None and moments[8]) or m.mtp_depth or split:
            return {}
        seq = moments[8][min(nth, len(moments[8]) - 1) if nth >= 0 else -1]
        rest = {k: v for k, v in blk.items()
                if k not in ("block_backward", "grad_recv", "zero_buffers", FREED)}
        base = sum(rest.values())
        # full recompute: each later block's second norm backward too (``norm_moment``)
        nm = norm_moment(blk, s) if recompute else {}
        # fp8 under ZeRO-3: each later block's down-projection dgrad too (``down_moment``),
        # the buckets of the blocks after it held, its own not yet opened
        dm = down_moment(blk, s, nth) if flat3 else {}
        best, top = {}, float("-inf")
        freed = gone
        for j, layer in enumerate(reversed(split_layers[s])):
            if j >= len(seq):
                break
            c = layer_cfg(m, layer)
            if j and not c.is_moe:
                block, saves = shape_terms(c)
                total = base + block + seq[j] - freed
                if total > top:
                    best, top = dict(rest, block_backward=block, zero_buffers=float(seq[j])), total
                    best[FREED] = -freed
                if nm:
                    cand = dict(rest, recompute_block=nm["recompute_block"],
                                norm_backward=nm["norm_backward"], zero_buffers=float(seq[j]))
                    if sum(cand.values()) - freed > top:
                        best, top = cand, sum(cand.values()) - freed
                        best[FREED] = -freed
                if dm:
                    cand = dict(rest, fp8_down_backward=dm["fp8_down_backward"],
                                zero_buffers=float(seq[j]) - first_bucket_bytes(s))
                    if sum(cand.values()) - freed > top:
                        best, top = cand, sum(cand.values()) - freed
                        best[FREED] = -freed
            freed += shape_terms(c)[1]
        return best

    shapes: dict[ModelConfig, tuple[float, float]] = {}

    def shape_terms(c: ModelConfig) -> tuple[float, float]:
        """A block shape's backward transient and its saved bytes, by the recompute mode
        (``stage_activation_bytes``)."""
        if c not in shapes:
            if par.recompute == "full":
                saves = block_input_bytes(c, par, micro_batch)
            else:
                fn = selective_layer if par.recompute == "selective" else layer_activations
                saves = sum(fn(c, par, micro_batch, opts).values())
            shapes[c] = (block_backward_bytes(c, par, micro_batch), saves)
        return shapes[c]

    def combine_saves(r: float) -> float:
        """What ``moe._Combine`` saves for r rows: the expert outputs (r · h · e), the fp32
        weights (r · 4) and the slots' int64 index (r · 8)."""
        return r * (m.hidden * e + 4 + 8)

    # the shared expert's saves (G, U and their product, cut over tp)
    shared_saves = 3 * tokens * m.shared_ffn / par.tp * e if m.is_moe and m.shared_expert else 0.0

    def combine_before_last(comb: dict[str, float], nth: int) -> dict[str, float]:
        """ZeRO-3 without pp, F: the combine of the MoE block before the last one, with the
        last block prefetched beside it (``zero_moments``' eighth) and the last block's saves
        (the MTP modules' whole, with MTP) and the loss's not made yet ({} where that block
        is not a MoE one)."""
        if not (zero and moments is not None and moments[7]):
            return {}
        ids = split_layers[n_stages - 1]
        if m.mtp_depth:  # the trunk's last block (the modules' block is the last unit)
            before = m.layers - 1
        elif len(ids) > 1:
            before = ids[-2]
        else:
            return {}
        if not m.is_moe_layer(before):
            return {}
        if m.mtp_depth:
            after = sum(mtp_activations(m, par, micro_batch, opts).values())
        else:
            last = split_layers[n_stages - 1][-1]
            after = sum(layer_activations(layer_cfg(m, last), par, micro_batch, opts).values())
        prev = dict(comb, zero_buffers=float(moments[7][min(nth, len(moments[7]) - 1)
                                                        if nth >= 0 else -1]))
        prev[FREED] = -(tail + after)
        return prev

    recipe = getattr(par, "fp8", "none")
    flat3 = par.zero == 3 and par.pp == 1 and moments is not None
    # fp8 under full recompute at tp: the re-run block's gate/up region is the last one
    # opened, its input (the norm's output) and under SP the gathered copy the fp8 columns
    # read referred to (``tensor.Columns``) beyond the fp8 saves (rowwise saves the input
    # without SP, the gathered copy under SP)
    rerun_region = 0.0
    if recompute and par.tp > 1 and recipe != "none":
        rerun_region = (0.0 if recipe == "rowwise" and not sp
                        else tokens * m.hidden * e / (par.tp if sp else 1))
        if sp and recipe != "rowwise":
            rerun_region += tokens * m.hidden * e

    def down_moment(blk: dict[str, float], s: int, nth: int) -> dict[str, float]:
        """fp8 (a dense first block, one backward; ZeRO-0/1/2, ZeRO-3 without pp): the down
        projection's dgrad at its product's cast (``fp8._Fp8Linear.backward``): its saved
        input not yet freed, the block output's gradient, under SP that gradient gathered
        and made contiguous (2 · tokens · h · e), rowwise's column-wise e4m3 cast of the
        saved input for the weight gradient (tokens · ffn/tp + 4 · ffn/tp; blockwise 4 per
        128×1 tile), the product in
        fp32 and its copy in the compute dtype (tokens · ffn/tp · (4 + e)); ZeRO-3's buffers
        those at the block's first gradient less that gradient's bucket (the unit gathered
        for backward and the one before prefetched, the root's gradient held); ZeRO-2's
        those the head's gradients opened."""
        if (recipe == "none" or split or not split_layers[s]
                or (par.zero == 2 and moments is None) or (par.zero == 3 and not flat3)):
            return {}
        c = layer_cfg(m, split_layers[s][-1])
        if c.is_moe or c.mlp != "swiglu":
            return {}
        f = c.ffn / par.tp
        down = {k: blk[k] for k in ("recompute_block", "pp_receives", "grad_recv",
                                    "mtp_backward") if k in blk}
        work = (0.0 if "grad_recv" in down else tokens * m.hidden * e / (par.tp if sp else 1))
        work += 2 * tokens * m.hidden * e if sp else 0.0
        # the dgrad's product (fp32, then in the compute dtype) or, where h is wide against
        # the tokens, the weight gradient's: dx kept, g's transposed cast, dW in fp32 and
        # in the weight's dtype
        g_cast = fp8_column_cast_bytes(tokens, c.hidden, recipe)
        work += max(tokens * f * (4 + e), tokens * f * e + g_cast + c.hidden * f * (4 + e))
        if recipe in ("rowwise", "blockwise"):  # the saved input's column-wise cast
            work += fp8_column_cast_bytes(tokens, f, recipe)
        down["fp8_down_backward"] = work
        if rerun_region:
            down["tp_last_input"] = rerun_region
        if flat3:
            down["zero_buffers"] = zero_at(0, nth) - first_bucket_bytes(s)
        elif zero:  # ZeRO-2: the buckets the head's gradients opened
            down["zero_buffers"] = zero_at(5, nth)
        return down

    def norm_moment(blk: dict[str, float], s: int) -> dict[str, float]:
        """``--recompute full`` (a dense first block, one backward): the re-run block's second
        norm at its backward (``layers._RMSNorm.backward``), its MLP's saves freed (its
        product, gate and up outputs; fp8: the MLP's two fp8 copies, the norm's output still
        held by its column region under tp, ``rerun_region``): the block
        output's gradient and the MLP's input gradient (T · h/sp · e each), the norm's fp32
        working set at its last subtraction (x̂, the fp32 gradient, dx̂, x̂ · mean and the
        difference: 20 · T · h/sp) and its weight gradient (h · e)."""
        if not recompute or split or not split_layers[s]:
            return {}
        c = layer_cfg(m, split_layers[s][-1])
        if c.is_moe or c.mlp != "swiglu":
            return {}
        acts = layer_activations(c, par, micro_batch, opts)
        h_sp = c.hidden / (par.tp if sp else 1)
        mlp_saves = acts["mlp"]
        if recipe in ("tensorwise", "blockwise"):
            mlp_saves += (fp8_copy_bytes(tokens, c.hidden, recipe)
                          + fp8_copy_bytes(tokens, c.ffn / par.tp, recipe))
        norm = {k: blk[k] for k in ("pp_receives", "grad_recv", "mtp_backward", "zero_buffers",
                                    "tp_last_input") if k in blk}
        norm["recompute_block"] = recompute - mlp_saves
        grads = (1 if "grad_recv" in norm else 2) * tokens * h_sp * e
        norm["norm_backward"] = grads + 20 * tokens * h_sp + c.hidden * e
        return norm

    def ring_moment(blk: dict[str, float], s: int) -> dict[str, float]:
        """``--recompute full`` under the cp2 ring (a dense first block, one backward): the
        re-run block's attention core at its second ring step's kernel
        (``context._ring_backward``), the MLP's and the second norm's saves freed (fp8: the
        MLP's and wo's fp8 copies too): the block output's and the core output's gradients
        (T · h/sp · e, T · hq · e), the fp32 working set — dout and out in the kernel's layout
        and dq (3 · A, A = T · hq · 4), the received K/V block, the own block's accumulated
        dK/dV and this step's (3 · K, K = 2 · T · kv · d · 4) — and the kernel's call: on cp
        rank 0 its second query chunk meets both received chunks (K and V expanded to the
        query heads and their gradients 4 · A, dq of half the rows A / 2, dK/dV summed to
        the kv heads K), on rank 1 both query chunks meet the first received one (2 · A,
        A, K / 2)."""
        if not (recompute and par.cp == 2 and par.cp_mode == "ring") or split \
                or opts.doc_mask or not split_layers[s]:  # (masked pairs: their own set)
            return {}
        c = layer_cfg(m, split_layers[s][-1])
        if c.is_moe or c.is_mla or c.mlp != "swiglu":
            return {}
        acts = layer_activations(c, par, micro_batch, opts)
        h_sp = c.hidden / (par.tp if sp else 1)
        hq = c.heads // par.tp * c.head_dim
        kv = 2 * max(1, c.kv_heads // par.tp) * c.head_dim
        a, k = tokens * hq * 4, tokens * kv * 4
        gone = acts["mlp"] + acts["norms"] / 2
        if recipe in ("tensorwise", "blockwise"):
            gone += (fp8_copy_bytes(tokens, c.hidden, recipe)
                     + fp8_copy_bytes(tokens, c.ffn / par.tp, recipe)
                     + fp8_copy_bytes(tokens, c.attn_dim / par.tp, recipe))
        ring = {k_: v for k_, v in blk.items()
                if k_ not in ("block_backward", "recompute_block", "tp_last_input")}
        ring["recompute_block"] = recompute - gone
        call = 4.5 * a + k if cp_rank == 0 else 3 * a + k / 2
        ring["ring_backward"] = tokens * h_sp * e + tokens * hq * e + 3 * a + 3 * k + call
        return ring

    def first_bucket_bytes(s: int) -> float:
        """The full-gradient bytes of the bucket the stage's first block gradient opens."""
        bks = buckets(m, par, pp_rank)
        for i, _ in arrival_runs(m, _state_key(par), pp_rank):
            if bks[i].unit >= 0:
                return float(bks[i].padded * grad_bytes(par))
        return 0.0

    def loop_moment(blk: dict[str, float]) -> dict[str, float]:
        """The experts' loop (``moe.Expert``, one SwiGLU per local expert), a MoE stage's B at
        its last MoE layer's first expert's end: the block output's gradient and the shared
        expert's input gradient (tokens · h/sp each, the first the received one under pp),
        the combine's gradient of the rows (r · h), the expert's last weight gradient before
        its bucket (f_e · h) and its rows' two input gradients and their sum (3 · r/E_local ·
        h), all in the compute dtype; freed there: the shared expert's saves (its backward
        ran first), the combine's (``combine_saves``) and the expert's own (G, U and their
        product: 3 · r/E_local · f_e). The weight gradients' buckets of the whole MLP are
        held (ZeRO: ``zero_moments``' fifth)."""
        loop = {k: blk[k] for k in ("recompute_block", "zero_buffers", "zb_stash",
                                    "zb_outputs", "pp_receives", "grad_recv", "zb_grads")
                if k in blk}
        r = experts_rows(m, par, micro_batch)
        r_e = r / max(1, m.experts // par.ep)
        grad_out = tokens * m.hidden * e / (par.tp if sp else 1)
        loop["experts_backward"] = (grad_out * (0 if "grad_recv" in loop else 1)
                                    + (grad_out if m.shared_expert else 0.0)
                                    + r * m.hidden * e + m.expert_ffn * m.hidden * e
                                    + 3 * r_e * m.hidden * e)
        loop[FREED] = -(combine_saves(r) + 3 * r_e * m.expert_ffn * e + shared_saves)
        return loop

    def forward_moment(t: dict[str, float], s: int) -> dict[str, float]:
        """A stage's F before the last, without tp, at its last block: the ring's (or
        Ulysses') buffers at its attention, when the block's MLP saves are not made yet
        (``cp_ring`` less those saves), or, a dense SwiGLU block, SiLU(G) beside the saved G
        and U (``mlp_forward``: tokens · ffn · e; ``layers.swiglu``)."""
        last = split_layers[s][-1] if split_layers[s] else None
        if last is None:
            return t
        c = layer_cfg(m, last)
        ring = dict(t)
        if "cp_ring" in ring:
            mlp_saves = layer_activations(c, par, micro_batch, opts)["mlp"]
            ring["cp_ring"] = max(0.0, ring["cp_ring"] - mlp_saves)
        if c.is_moe or c.mlp != "swiglu":
            return ring
        silu = dict(t, mlp_forward=tokens * c.ffn * e)
        silu.pop("cp_ring", None)
        return max((ring, silu), key=lambda d: sum(d.values()))

    tail = sum(stage_extra_activations(m, par, micro_batch, n_stages == 1, True, opts)[k]
               for k in ("final_norm", "logits"))  # what the loss saves, on the last stage
    actions = schedule_actions(par, pp_rank)
    last_b = max(i for i, a in enumerate(actions) if a[0] == "B")
    stash = outs = 0.0  # split: what the B's keep for their W's, what the F's keep for B
    held = receives_held(par, pp_rank)
    message = tokens * m.hidden * e / (par.tp if sp else 1)  # an activation or its gradient
    for i, (kind, mb, s) in enumerate(actions):
        unfused = split and (mb, s) not in fused
        if kind == "F":
            live[s] += 1
            saved += per[s]
            if unfused:  # the records' outputs, from this F to its B (then in the stash)
                outs += zb[s][0]
        t: dict[str, float] = dict(inflight) if kind in ("F", "B") else {}
        if stash:
            t["zb_stash"] = stash
        if outs:
            t["zb_outputs"] = outs
        if held[i]:  # receives posted ahead, and arrived before they are wanted
            t["pp_receives"] = held[i] * message
        if kind == "W" and unfused:
            t["zb_weight_grads"] = zb_weight_grads_bytes(m, par, s)
            out.append(Phase(f"{kind} {mb} {s}", kept, saved, t))
            stash -= zb[s][2]
            continue
        nth = 0 if mb == 0 else (-1 if mb == par.micro_batches - 1 else 1)
        if kind == "F" and s == n_stages - 1:  # after the blocks: no all-to-all, no ring
            for k in LOSS_IDLE:
                t.pop(k, None)
            t["loss_forward"] = loss_forward_bytes(m, par, micro_batch)
        elif kind == "F" and sp:  # a region opens (its gather) before the last one closes
            t["sp_gather"] = 2 * inflight["sp_gather"] + tokens * m.hidden * e / par.tp
        elif kind == "F" and par.tp > 1:  # the last region's input and the new one's
            t["tp_regions"] = 2 * tokens * m.hidden * e
        elif kind == "F":
            t = forward_moment(t, s)
        if kind == "B" and sp and s != n_stages - 1:  # the last forward's region (until
            # the step's last backward), the backward's re-gather of x and the full-width
            # input gradient before its reduce-scatter
            t["sp_gather"] = (2 + (i < last_b)) * inflight["sp_gather"]
        if kind == "F" and zero:  # the loss's moment: the root gathered (ZeRO-3), the
            # gradient buffers of the earlier micro-batches held
            if moments is not None and moments[2]:
                t["zero_buffers"] = float(moments[2][min(nth, len(moments[2]) - 1)
                                                     if nth >= 0 else -1])
            elif moments is not None and mb > 0:
                t["zero_buffers"] = cb.get("zero_full_grads", 0.0)
            else:
                t["zero_buffers"] = cb.get("zero3_gather", 0.0) if mb == 0 else zero
        if kind == "F" and grouped and has_experts(s):  # the experts' forward: the stacked weights
            # and SiLU(G) beside G and U (r · f_e · e); the all-to-all buffers are idle
            moe = {k: v for k, v in t.items() if k not in ("ep_a2a", "loss_forward")}
            moe["expert_stack"] = cb.get("expert_stack", 0.0)
            moe["experts_forward"] = experts_rows(m, par, micro_batch) * m.expert_ffn * e
            if zero and moments is not None and moments[6]:  # the last block gathered
                moe["zero_buffers"] = float(moments[6][min(nth, len(moments[6]) - 1)
                                                       if nth >= 0 else -1])
            if s == n_stages - 1:  # the loss's saves (the last norm, the logits) not made yet
                moe[FREED] = -tail
            t = max((t, moe), key=lambda d: sum(d.values()))
        if kind == "F" and has_experts(s):  # the last MoE layer's combine: the un-permuted
            # slots and their weighted product beside the experts' saved outputs
            comb = {k: v for k, v in t.items()
                    if k not in ("ep_a2a", "loss_forward", "tp_regions", "expert_stack",
                                 "experts_forward")}
            comb["moe_combine"] = 2 * experts_rows(m, par, micro_batch) * m.hidden * e
            if zero and moments is not None and moments[6]:  # the last block gathered
                comb["zero_buffers"] = float(moments[6][min(nth, len(moments[6]) - 1)
                                                        if nth >= 0 else -1])
            if s == n_stages - 1:  # the loss's saves (the last norm, the logits) not made yet
                comb[FREED] = -tail
            t = max((t, comb, combine_before_last(comb, nth)), key=lambda d: sum(d.values()))
        if kind == "B":
            t = backward_moment(t, s == n_stages - 1, s, nth, unfused)
            if unfused:  # the B's end: every dL/dy made, autograd's saves not yet freed
                end = {k: v for k, v in t.items()
                       if k in ("zb_stash", "zb_outputs", "zero_buffers", "tp_last_input")}
                end["zb_grads"] = zb[s][1]
                t = max((t, end), key=lambda d: sum(d.values()))
            if zero and saved - per[s] + zero > saved + sum(t.values()):  # the buffers' peak
                # once this micro-batch's activations are released
                out.append(Phase(f"{kind} {mb} {s}", kept, saved - per[s],
                                 {"zero_buffers": zero}))
                if kind == free:
                    live[s] -= 1
                    saved -= per[s]
                if unfused:
                    stash += zb[s][2]
                    outs -= zb[s][0]
                continue
        # the saved bytes at the moment (a last stage's B: the loss's saves freed there)
        out.append(Phase(f"{kind} {mb} {s}", kept, saved + t.pop(FREED, 0.0), t))
        if kind == free:
            live[s] -= 1
            saved -= per[s]
        if unfused and kind == "B":
            stash += zb[s][2]
            outs -= zb[s][0]
    # after the step's last forward: the last column region's input (and under SP its gathered
    # copy) stays referenced until the next forward opens a region (``tensor.Columns``)
    after: dict[str, float] = {}
    if par.tp > 1:  # under SP the last stage keeps two shards (the final norm's region)
        shards = 2 if sp and n_stages - 1 in stages else 1
        after["tp_last_input"] = shards * tokens * m.hidden * e / (par.tp if sp else 1)
    end = float(moments[1]) if moments is not None else zero
    out.append(Phase("reduce", kept, 0.0, {**after, "zero_buffers": end} if zero else after))
    out.append(Phase("clip", kept, 0.0, {**after, "clip": clip_bytes(m, par, pp_rank)}))
    opt = dict(after)
    if grad_bytes(par) != 4:
        opt["optimizer"] = 4.0 * sum(b.shard if par.zero >= 1 else b.padded
                                     for b in buckets(m, par, pp_rank))
    gather8 = fp8_publish_bytes(m, par, pp_rank)
    if gather8:
        opt["fp8_gather"] = gather8
    out.append(Phase("optimizer", kept, 0.0, opt))
    return out


@lru_cache(maxsize=8192)
def step_peak(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
              opts: ActivationOptions = EAGER, optimizer: str = "adamw",
              dense_index: int = 0, expert_index: int = 0, cp_rank: int = 0) -> Phase:
    """The phase whose live bytes are largest (the first of equals)."""
    return max(step_phases(m, par, micro_batch, pp_rank, opts, optimizer, dense_index,
                           expert_index, cp_rank), key=lambda p: p.total)


def with_peak(mem: RankMemory, m: ModelConfig, par: ParallelConfig, micro_batch: int,
              opts: ActivationOptions = EAGER, optimizer: str = "adamw") -> RankMemory:
    """``mem`` (``memory.rank_memory``) with its step peak filled in."""
    p = step_peak(m, par, micro_batch, mem.pp_rank, opts, optimizer)
    return replace(mem, peak=p.total, peak_phase=p.name,
                   peak_transients={k: v for k, v in p.transients.items() if v})


def largest_rank(m: ModelConfig, par: ParallelConfig, micro_batch: int,
                 opts: ActivationOptions = EAGER, optimizer: str = "adamw") -> RankMemory:
    """The pipeline rank whose step peaks highest (ties: the lowest rank)."""
    return max((with_peak(rank_memory(m, par, micro_batch, r, opts, optimizer), m, par,
                          micro_batch, opts, optimizer)
                for r in candidate_ranks(par)), key=lambda r: r.peak)
