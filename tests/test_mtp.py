"""Multi-token prediction (``ModelConfig.mtp_depth``, ``fived.model.mtp``; DeepSeek-V3 §2.2):
the model's objective and gradients equal a hand-written computation of the modules (each on
the sequence truncated to the positions that have a target, DeepSeek's h_{1:T−k}); the
layouts' losses — the trunk's and each module's — and gradients equal one rank's; a sequence
too short is one clear error."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.model import build_model
from fived.testing import small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import TOL, check_parity, one_rank, rel_diff, train_runs  # noqa: E402

MTP = replace(preset("tiny"), name="mtp-tiny", hidden=32, heads=4, kv_heads=2, ffn=64,
              layers=2, seq_len=16, mtp_depth=2, mtp_loss_weight=0.3)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def hand_objective(model, x: torch.Tensor, y: torch.Tensor, skip: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, list]:
    """L⁰ + λ/D Σ Lᵏ written out: t = x ⧺ y's last token; module k over the first s−k
    positions only, reading E[t_{i+k}] and predicting t_{i+1+k} (sums of token losses);
    ``skip`` (as y): the targets no loss counts, the trunk's and every module's."""
    if skip is not None:  # a skipped target is ignore_index for every CE, as for the trunk's
        return _hand(model, x, y, torch.where(skip, -100, y))
    return _hand(model, x, y, y)


def _hand(model, x: torch.Tensor, y: torch.Tensor, scored: torch.Tensor
          ) -> tuple[torch.Tensor, list]:
    cfg = model.cfg
    s, eps = x.shape[1], cfg.norm_eps
    t = torch.cat([x, y[:, -1:]], dim=1)  # t_0 .. t_s
    pos = torch.arange(s)
    h = model.embed_tokens(x)
    from fived.model.layers import rope_tables
    rope = rope_tables(pos, cfg.head_dim, cfg.rope_theta)
    for blk in model.layers.values():
        h = blk(h, rope)
    h = rms(h, model.norm.weight, eps)
    head = model.lm_head.weight
    total = F.cross_entropy((h @ head.t()).flatten(0, 1), scored.flatten(), reduction="sum")
    each = []
    for k in range(1, cfg.mtp_depth + 1):
        mod = model.mtp._modules[str(k - 1)]
        n = s - k
        h = h[:, :n]
        e = F.embedding(t[:, k:k + n], model.embed_tokens.weight)
        z = torch.cat([rms(e, mod.enorm.weight, eps), rms(h, mod.hnorm.weight, eps)], -1)
        z = z @ mod.eh_proj.weight.t()
        r = rope_tables(torch.arange(n), cfg.head_dim, cfg.rope_theta)
        h = rms(mod.block(z, r), mod.norm.weight, eps)
        lk = F.cross_entropy((h @ head.t()).flatten(0, 1), scored[:, k:k + n].flatten(),
                             reduction="sum")
        each.append(lk)
    return total + cfg.mtp_loss_weight / cfg.mtp_depth * sum(each), each


@pytest.mark.parametrize("depth", [1, 2])
def test_objective_and_gradients_equal_the_hand_computation(depth):
    cfg = replace(MTP, mtp_depth=depth)
    model = build_model(cfg, seed=3)
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, cfg.vocab, (3, cfg.seq_len + 1), generator=g)
    x, y = t[:, :-1], t[:, 1:]
    got = model(x, torch.arange(cfg.seq_len), y)
    got.backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want, each = hand_objective(model, x, y)
    want.backward()
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (float(got), float(want))
    tally = model.mtp.tally
    assert torch.allclose(tally, torch.tensor([float(v.detach()) for v in each], dtype=torch.float64),
                          rtol=1e-6)
    for n, p in model.named_parameters():
        d = (mine[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)
        assert d < 1e-5, (n, float(d))
    # every module's parameters learn (the objective reaches them)
    assert all(mine[n].abs().sum() > 0 for n in mine if n.startswith("mtp."))


def test_marked_targets_are_skipped_by_every_module_and_the_tallies_are_the_trunks():
    """The data pipeline's marks on the targets (``fived.data.vocab``): ``--eos-target
    ignore``'s skip bit and a mixture's source. Every module skips the targets the trunk skips
    and embeds the token id alone (the objective and gradients equal the hand computation with
    those targets left out), and the per-source tallies hold the trunk's losses only, which
    sum to its loss (the step's ``loss``). Mutations seen to fail: the modules' losses tallied
    too (the per-source sum 705.9 against the trunk's 250.2); the marks left on the embedded
    id (IndexError)."""
    from fived.data.vocab import (
        IGNORE_BIT,
        SOURCE_SHIFT,
        ignore_marked_targets,
        tally_sources,
    )

    model = build_model(MTP, seed=3)
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, MTP.vocab, (4, MTP.seq_len + 1), generator=g)
    x, y = t[:, :-1], t[:, 1:]
    skip = torch.rand(y.shape, generator=g) < 0.25
    source = torch.tensor([0, 1, 1, 0])[:, None]
    marked = torch.where(skip, y | IGNORE_BIT, y) + (source << SOURCE_SHIFT)
    assert ignore_marked_targets(model) == 1
    tallies = tally_sources(model, 2)
    got = model(x, torch.arange(MTP.seq_len), marked)
    got.backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want, each = hand_objective(model, x, y, skip)
    want.backward()
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (float(got), float(want))
    for n, p in model.named_parameters():
        d = (mine[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30)
        assert d < 1e-5, (n, float(d))
    trunk = float(want.detach()) - MTP.mtp_loss_weight / MTP.mtp_depth * sum(
        float(v.detach()) for v in each)
    by_source = [float(v) for v in tallies[0].tally]
    assert abs(sum(by_source) - trunk) < 1e-5 * trunk, (by_source, trunk)
    rows = source.flatten() == 0  # source 0's rows alone: the trunk's CE over their kept tokens
    with torch.no_grad():
        h = model.norm(_trunk(model, x[rows]))
        ce = F.cross_entropy((h @ model.lm_head.weight.t()).flatten(0, 1),
                             torch.where(skip[rows], -100, y[rows]).flatten(), reduction="sum")
    assert abs(by_source[0] - float(ce)) < 1e-5 * float(ce), (by_source, float(ce))


def _trunk(model, x: torch.Tensor) -> torch.Tensor:
    from fived.model.layers import rope_tables

    h = model.embed_tokens(x)
    rope = rope_tables(torch.arange(x.shape[1]), model.cfg.head_dim, model.cfg.rope_theta)
    for blk in model.layers.values():
        h = blk(h, rope)
    return h


def test_evaluation_and_generation_ignore_the_modules():
    model = build_model(MTP, seed=3)
    x = torch.randint(0, MTP.vocab, (2, MTP.seq_len))
    y = torch.randint(0, MTP.vocab, (2, MTP.seq_len))
    with torch.no_grad():
        ev = model(x, torch.arange(MTP.seq_len), y)
    plain = build_model(replace(MTP, mtp_depth=0), seed=3)
    with torch.no_grad():
        assert torch.equal(ev, plain(x, torch.arange(MTP.seq_len), y))


def test_a_sequence_too_short_is_one_error():
    with pytest.raises(ConfigError) as e:
        validate(replace(MTP, seq_len=2), ParallelConfig())
    assert len(e.value.problems) == 1 and "mtp_depth 2" in str(e.value)
    validate(replace(MTP, seq_len=3), ParallelConfig())  # module 2: one position, one target
    with pytest.raises(ConfigError, match="--cp 4"):  # a zigzag chunk of 2 < D = 3 tokens
        validate(replace(MTP, mtp_depth=3), ParallelConfig(cp=4))


# ------------------------------------------------------------------------ layouts
TRAIN = small_train(steps=3)
TIED = replace(MTP, name="tied-pp", mtp_depth=0, tied_embeddings=True)
MOE = replace(preset("tiny-moe"), name="mtp-moe", hidden=32, heads=4, kv_heads=2, ffn=64,
              layers=2, seq_len=16, mtp_depth=1, first_dense_layers=1, router="sigmoid",
              balance="bias")


M4 = replace(MTP, name="mtp-4-layers", layers=4)  # two chunks per pipeline rank
TIED4 = replace(M4, name="tied-4-layers", mtp_depth=0, tied_embeddings=True)


@pytest.fixture(scope="module")
def reference():
    return {m.name: one_rank(m, TRAIN) for m in (MTP, TIED, MOE)}


def check_mtp_parity(out: dict, ref: dict, what, m=None, p=None) -> None:
    """``check_parity`` (the trunk's losses, every gradient) and each module's loss, every
    step, every rank; with the layout (``m``, ``p``) the ledger equals every rank's recorded
    model-state and traffic bytes exactly (``ledger --check``: the embedding group's all-reduce,
    the modules' tp and cp collectives included)."""
    from fived.ledger import verify

    check_parity(out, ref, what)
    if m is not None:
        for s in out["ranks"]:
            assert verify.compare_record(m, p, TRAIN.global_batch, s["history"][-1]) == [], what
    want = [h.get("mtp_losses") for h in ref["ranks"][0]["history"]]
    for s in out["ranks"]:
        got = [h.get("mtp_losses") for h in s["history"]]
        assert (got[0] is None) == (want[0] is None), what
        for g, w in zip(got, want):
            if w is not None:
                assert len(g) == len(w) and rel_diff(g, w) < TOL, (what, g, w)


WORLD2_FAST = [(MTP, ParallelConfig(cp=2)), (MTP, ParallelConfig(pp=2, micro_batches=2)),
               (TIED, ParallelConfig(pp=2, micro_batches=2))]
WORLD2_SLOW = [(MTP, ParallelConfig(tp=2, sequence_parallel=True)),
               (MTP, ParallelConfig(cp=2, cp_mode="ulysses")),
               (MTP, ParallelConfig(dp=2, zero=3)),
               (MTP, ParallelConfig(pp=2, micro_batches=4, schedule="1f1b", dp=1)),
               (TIED, ParallelConfig(pp=2, micro_batches=2, zero=1)),
               (MTP, ParallelConfig(pp=2, micro_batches=2, recompute="full")),
               # V-shaped: rank 0 holds the first and the last stage, one embedding for both
               (M4, ParallelConfig(pp=2, micro_batches=4, schedule="zb-v", virtual_stages=2)),
               (M4, ParallelConfig(pp=2, micro_batches=4, schedule="dualpipe-v",
                                   virtual_stages=2)),
               (M4, ParallelConfig(pp=2, micro_batches=4, schedule="interleaved",
                                   virtual_stages=2)),
               (TIED4, ParallelConfig(pp=2, micro_batches=4, schedule="zb-h1"))]


def test_world2_layouts_match_one_rank(reference):
    """cp2 (the shifted targets fetched across the zigzag chunks), pp2 with the modules on the
    last stage (the embedding group sums the two copies' gradients) and pp2 with tied
    embeddings, no MTP: the trunk's and each module's losses and the gradients of one rank,
    and the ledger's bytes of every rank.

    Time: one spawn of three world-2 layouts, 9 s on 2 cores (15 s loaded), and the module's
    one-rank references, 4.5 s."""
    for (m, p), out in zip(WORLD2_FAST, train_runs([(m, p, TRAIN) for m, p in WORLD2_FAST])):
        check_mtp_parity(out, reference[m.name], (m.name, p.describe()), m, p)


@pytest.mark.slow
def test_world2_layouts_match_one_rank_slow(reference):
    """tp2+SP, cp2 Ulysses, dp2 ZeRO-3, pp2 1F1B, pp2 tied under ZeRO-1, full recompute, ZB-V,
    DualPipe-V, interleaved, ZB-H1 tied."""
    for m in (M4, TIED4):
        reference.setdefault(m.name, one_rank(m, TRAIN))
    for (m, p), out in zip(WORLD2_SLOW, train_runs([(m, p, TRAIN) for m, p in WORLD2_SLOW])):
        check_mtp_parity(out, reference[m.name], (m.name, p.describe()), m, p)


@pytest.mark.slow
def test_world4_and_16_layouts_match_one_rank(reference):
    """A MoE model (sigmoid routing, the loss-free bias; the module's block is a MoE block) at
    ep2·tp2 with SP, pp4 with tied embeddings (the embedding group skips the middle stages),
    and one 4-D layout: tp2·cp2·pp2·dp2 with ZeRO-1."""
    w4 = [(MOE, ParallelConfig(ep=2, tp=2, sequence_parallel=True)),
          (TIED, ParallelConfig(pp=4, micro_batches=4))]
    tied4 = replace(TIED, layers=4)
    reference[tied4.name + "4"] = one_rank(tied4, TRAIN)
    w4[1] = (tied4, w4[1][1])
    outs = train_runs([(m, p, TRAIN) for m, p in w4])
    check_mtp_parity(outs[0], reference[MOE.name], "ep2·tp2·sp", *w4[0])
    check_mtp_parity(outs[1], reference[tied4.name + "4"], "pp4 tied", *w4[1])
    p16 = ParallelConfig(tp=2, cp=2, pp=2, dp=2, zero=1, micro_batches=2)
    out = train_runs([(MTP, p16, TRAIN)])[0]
    check_mtp_parity(out, reference[MTP.name], p16.describe(), MTP, p16)


@pytest.mark.slow
@pytest.mark.parametrize("par", [ParallelConfig(pp=2, micro_batches=2),
                                 ParallelConfig(tp=2, pp=2, sequence_parallel=True,
                                                micro_batches=2),
                                 ParallelConfig(cp=2, dp=2, zero=3)])
def test_dry_run_equals_the_ledger(par):
    """The dry run (fake tensors) of a D = 2 model: storages and traffic by (group, op) equal
    the ledger's, the saved activations within its tolerance (``verify.compare_record``)."""
    from fived.config import TrainConfig
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    m = replace(preset("tiny"), mtp_depth=2)
    out = dry_run(m, par, TrainConfig(global_batch=4), distinct_ranks(par), show=False)
    assert verify.compare_record(m, par, 4, out) == []


# ------------------------------------------------------------------------ checkpoint, export
def test_deepseek_names_round_trip():
    """Every MTP parameter's DeepSeek-V3 name (layer L + k) maps back to it; the shared copies
    map to nothing (the trunk's embedding and head are read instead)."""
    from fived.checkpoint import hf

    cfg = replace(MOE, mtp_depth=2)
    names = [n for n in hf.param_shapes(cfg) if n.startswith("mtp.")]
    assert "mtp.1.block.block_sparse_moe.experts.0.w1.weight" in names
    for n in names:
        key = hf.mtp_to_layer(n, cfg.layers)
        assert key.startswith(f"layers.{cfg.layers + int(n.split('.')[1])}.")
        assert hf.mtp_from_layer(key, cfg.layers, cfg.mtp_depth) == n
    assert hf.mtp_to_layer("mtp.0.norm.weight", 2) == "layers.2.shared_head.norm.weight"
    for a in hf.mtp_aliases(cfg):
        assert hf.mtp_from_layer(hf.mtp_to_layer(a, cfg.layers), cfg.layers, 2) is None
    assert hf.mtp_from_layer("layers.1.mlp.up_proj.weight", cfg.layers, 2) == (
        "layers.1.mlp.up_proj.weight")


@pytest.mark.slow
def test_checkpoint_export_and_import_carry_the_modules(tmp_path):
    """Trained at pp2 (the modules and the embedding's copy on the last stage), saved (DCP,
    fived's names), exported: the modules under DeepSeek-V3's names (layer L + k: enorm, hnorm,
    eh_proj, the block, shared_head.norm, and the shared embedding and head repeated), D as
    ``num_nextn_predict_layers``; transformers' Llama reads the export (the MTP tensors unused)
    with fived's trunk logits; ``fived import`` gives back every tensor."""
    transformers = pytest.importorskip("transformers")
    from hf_ranks import _train_and_save
    from safetensors import safe_open

    from fived.checkpoint.convert import whole_model
    from fived.checkpoint.storage import read_manifest, resolve
    from fived.testing import run_ranks

    cfg = replace(MTP, mtp_depth=1)
    ck, out, back = tmp_path / "ck", tmp_path / "hf", tmp_path / "back"
    run_ranks(_train_and_save, 2, cfg, ParallelConfig(pp=2, micro_batches=2),
              small_train(steps=2, global_batch=4, save_dir=str(ck)), timeout=600)
    ckpt = resolve(ck)
    saved = whole_model(ckpt, read_manifest(ckpt))
    assert any(n.startswith("mtp.0.block.") for n in saved)
    from parity_helpers import run_cli
    assert run_cli("export", str(ck), "--hf", str(out)).returncode == 0
    keys = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keys.update({k: h.get_tensor(k) for k in h.keys()})
    L = cfg.layers
    for own, name in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                      ("norm", "shared_head.norm")):
        assert torch.equal(keys[f"model.layers.{L}.{name}.weight"], saved[f"mtp.0.{own}.weight"])
    assert torch.equal(keys[f"model.layers.{L}.self_attn.q_proj.weight"],
                       saved["mtp.0.block.self_attn.q_proj.weight"])
    assert torch.equal(keys[f"model.layers.{L}.embed_tokens.weight"],
                       saved["embed_tokens.weight"])
    assert torch.equal(keys[f"model.layers.{L}.shared_head.head.weight"],
                       saved["lm_head.weight"])
    import json
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    hfm = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model = build_model(cfg, 0)
    model.load_state_dict(saved)
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x, torch.arange(cfg.seq_len))
        got = hfm.eval()(x).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert run_cli("import", str(out), "--save-dir", str(back)).returncode == 0
    again = whole_model(resolve(back), read_manifest(resolve(back)))
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[n], saved[n].to(again[n].dtype)) for n in saved)


@pytest.mark.slow
def test_hybrid_sharding_with_the_embedding_group_matches_one_rank(reference):
    """pp2 × hybrid sharding (dp 4 = 2 shards × 2 replicas): the embedding's bucket is reduced
    over its shard group, across the replicas, then summed over the embedding group — with MTP
    under ZeRO-3 and with tied embeddings under ZeRO-2; ``ledger --check`` exact."""
    lays = [(MTP, ParallelConfig(pp=2, dp=4, dp_shard=2, dp_replicate=2, zero=3,
                                 micro_batches=2)),
            (TIED, ParallelConfig(pp=2, dp=4, dp_shard=2, dp_replicate=2, zero=2,
                                  micro_batches=2))]
    for (m, p), out in zip(lays, train_runs([(m, p, TRAIN) for m, p in lays])):
        check_mtp_parity(out, reference[m.name], p.describe(), m, p)
