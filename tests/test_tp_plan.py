"""The tensor-parallel plan (``fived.parallel.tensor.TP_PLAN``) covers every parameter: after
``apply_tp`` each parameter's ``Placement`` is the one its name calls for (a column cut on the
output features in tp chunks — kv chunks for k/v —, a row cut on the input features, vocab rows,
or whole; norms, the router and the routed experts partial over tp under sequence parallelism,
the q/k norms always), for tiny, tiny-moe, qwen3-moe-tiny and the Qwen attention shapes, with
and without SP, at tp 2 and 4, whole and as pipeline parts. Every row of the plan is needed
(dropping any one changes a placement, a module or a count reduction, or leaves a parameter
unnamed), and a module no row names is an error. No ranks: the cut is made in this process on
meta tensors with a group that has no process group (cutting talks to no one)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from fived.config import preset
from fived.model.llama import build_model
from fived.model.moe import moe_layers
from fived.parallel.placement import Placement, replicated
from fived.parallel.tensor import TP_PLAN, apply_tp
from fived.ranks.grid import DimGroup

QWEN = replace(preset("tiny"), name="attn-shapes", hidden=32, heads=4, kv_heads=2,
               head_size=12, qk_norm=True, qkv_bias=True, ffn=64, layers=2)
SHARED = replace(preset("tiny-moe"), name="shared-gate", shared_expert=True,
                 shared_expert_gate=True, first_dense_layers=1, layers=3)
MLA_PLAIN_Q = replace(preset("deepseek-v3-tiny"), name="mla-plain-q", q_lora_rank=0)
MODELS = [preset("tiny"), preset("tiny-moe"), preset("qwen3-moe-tiny"), QWEN, SHARED,
          preset("deepseek-v3-tiny"), MLA_PLAIN_Q,
          replace(preset("tiny"), name="tied", tied_embeddings=True)]
SPLITS = ("whole", "first", "last")


def cut(cfg, tp: int, rank: int, sp: bool, split: str = "whole", plan=TP_PLAN):
    model = build_model(cfg, 0, device="meta", init=False)
    n = cfg.layers
    if split == "first":
        model = model.part(list(range(n // 2)), True, False)
    elif split == "last":
        model = model.part(list(range(n // 2, n)), False, True)
    pl = replicated(model.named_parameters())
    group = DimGroup("tp", tuple(range(tp)), rank)
    apply_tp(model, group, pl, sp, True, plan=plan)
    return model, pl, group


def expected(name: str, shape: tuple[int, ...], cfg, tp: int, rank: int, sp: bool) -> Placement:
    """The placement a parameter's name calls for, written from the names alone."""
    kv = min(tp, cfg.kv_heads)
    module = name.split(".")[-2]
    on_sp = ("tp",) if sp else ()
    if name in ("embed_tokens.weight", "lm_head.weight"):
        dim, parts, index, grad_sum = 0, tp, rank, ()
    elif ".experts." in name or module in ("gate", "shared_expert_gate"):
        dim, parts, index, grad_sum = 0, 1, 0, on_sp  # the router and the routed experts
    elif module in ("q_a_proj", "kv_a_proj_with_mqa"):  # MLA's down-projections: whole
        dim, parts, index, grad_sum = 0, 1, 0, on_sp
    elif module in ("q_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj"):
        dim, parts, index, grad_sum = 0, tp, rank, ()
    elif module in ("k_proj", "v_proj"):
        dim, parts, index, grad_sum = 0, kv, rank * kv // tp, ()
    elif module in ("o_proj", "down_proj"):
        dim, parts, index, grad_sum = 1, tp, rank, ()
    elif module in ("q_norm", "k_norm"):
        dim, parts, index, grad_sum = 0, 1, 0, ("tp",)
    elif module.endswith("norm"):
        dim, parts, index, grad_sum = 0, 1, 0, on_sp
    else:
        raise AssertionError(f"no expectation for {name}")
    return Placement(name, shape, dim, parts, index, "dense", grad_sum)


@pytest.mark.parametrize("cfg", MODELS, ids=lambda c: c.name)
def test_plan_places_every_parameter(cfg):
    for tp in (2, 4):
        for rank in range(tp):
            for sp in (False, True):
                for split in SPLITS if not cfg.tied_embeddings else ("whole",):
                    model, pl, group = cut(cfg, tp, rank, sp, split)
                    params = dict(model.named_parameters())
                    assert set(params) == set(pl)
                    for name, p in params.items():
                        want = expected(name, pl[name].shape, cfg, tp, rank, sp)
                        assert pl[name] == want, (tp, rank, sp, split)
                        local = list(want.shape)
                        local[want.dim] //= want.parts
                        assert list(p.shape) == local, name
                    for moe in moe_layers(model):
                        groups = moe.reduce_counts.groups if moe.reduce_counts else []
                        assert groups == ([group] if sp else [])
                    if model.last:
                        assert type(model.loss).__name__ == "VocabParallelLoss"
                        assert type(model.lm_head).__name__ in ("VocabHead", "TiedVocabHead")
                    if model.first:
                        assert type(model.embed_tokens).__name__ == "VocabEmbedding"


def signature(cfg, sp: bool, plan) -> object:
    """Everything a cut decides, or the error it raises."""
    try:
        model, pl, _ = cut(cfg, 2, 1, sp, plan=plan)
    except ValueError as e:
        return str(e)
    return (list(pl.values()), [(n, type(m).__name__) for n, m in model.named_modules()],
            [len(m.reduce_counts.groups) if m.reduce_counts else 0 for m in moe_layers(model)])


def test_every_row_is_needed():
    """Dropping any one row of the plan changes what some model's cut decides."""
    mtp = replace(QWEN, name="mtp", mtp_depth=1)  # its rows: the modules' norms, eh_proj
    cases = [(cfg, sp) for cfg in (QWEN, SHARED, MODELS[5], MLA_PLAIN_Q, MODELS[-1], mtp)
             for sp in (False, True)]
    full = [signature(cfg, sp, TP_PLAN) for cfg, sp in cases]
    for i, row in enumerate(TP_PLAN):
        less = TP_PLAN[:i] + TP_PLAN[i + 1:]
        assert any(signature(cfg, sp, less) != f for (cfg, sp), f in zip(cases, full)), row


def test_a_module_no_row_names_is_an_error():
    model = build_model(preset("tiny"), 0, device="meta", init=False)
    model.layers["1"].self_attn.extra = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.extra\.weight"):
        apply_tp(model, DimGroup("tp", (0, 1), 0), replicated(model.named_parameters()))
    assert torch.Size([4, 4]) == model.layers["1"].self_attn.extra.weight.shape
