"""Hugging Face in and out (fived.checkpoint.hf): transformers models built from small random
configs (GQA, tied and untied embeddings, rope_theta != 10000, rms_norm_eps != fived's default;
Mixtral for MoE) are saved locally, imported into fived — one rank, tp2·pp2, tp2·dp2 (tied),
ep2·pp2 (Mixtral) — and give transformers' logits to 1e-5 in fp32; a fived checkpoint exported
with ``fived export`` loads in transformers and gives fived's logits. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fived.checkpoint import hf  # noqa: E402
from fived.config import ConfigError, ParallelConfig  # noqa: E402
from fived.testing import run_ranks, small_train  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
# the rank functions live where transformers is not imported: a rank imports their module
from hf_ranks import SEQ, _layout_logits, _train_and_save, tokens  # noqa: E402,F401,I001
from parity_helpers import run_cli  # noqa: E402,I001

SHAPE = dict(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, rope_theta=50000.0, rms_norm_eps=1e-6)


def make_hf(path, kind: str = "llama", tied: bool = False, shard: str | None = None):
    """A random transformers model saved to ``path`` (in files of at most ``shard``, with
    ``model.safetensors.index.json``); returns it (eval, fp32)."""
    torch.manual_seed(0)
    if kind == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE,
                                                                   tie_word_embeddings=tied))
    else:
        m = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **SHAPE, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=tied))
    with torch.no_grad():  # norms away from 1, so a wrong eps or a missed norm shows
        for n, p in m.named_parameters():
            if "norm" in n:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    m.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return m.eval()


def hf_logits(model_or_dir) -> np.ndarray:
    m = model_or_dir
    if not isinstance(m, torch.nn.Module):
        m = transformers.AutoModelForCausalLM.from_pretrained(str(m), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(tokens()).logits.float().numpy()


def close(a, b, tol=1e-5) -> float:
    err = float(np.abs(a - b).max() / np.abs(b).max())
    assert err < tol, err
    return err


# ------------------------------------------------------------------ one rank
@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("mixtral", False)])
def test_import_gives_transformers_logits(tmp_path, kind, tied):
    ref = make_hf(tmp_path, kind, tied)
    from fived.model import build_model

    cfg = hf.model_config(hf.read_config(tmp_path, "--init-from"), seq_len=SEQ)
    assert cfg.rope_theta == 50000.0 and cfg.norm_eps == 1e-6 and cfg.kv_heads == 2
    assert cfg.tied_embeddings == tied and cfg.is_moe == (kind == "mixtral")
    model = build_model(cfg, 0)
    hf.load_hf_into(model, tmp_path)
    with torch.no_grad():
        got = model(tokens(), torch.arange(SEQ)).numpy()
    close(got, hf_logits(ref))


# ------------------------------------------------------------------ any layout
def test_import_into_tp_pp_ep_layouts_gives_transformers_logits(tmp_path):
    dirs = {k: tmp_path / k for k in ("untied", "tied", "moe")}
    refs = {"untied": make_hf(dirs["untied"], shard="60KB"), "tied": make_hf(dirs["tied"], tied=True),
            "moe": make_hf(dirs["moe"], "mixtral")}
    jobs = [(dirs["untied"], ParallelConfig(tp=2, pp=2)),
            (dirs["tied"], ParallelConfig(tp=2, dp=2)),  # pp > 1 is refused for tied models
            (dirs["moe"], ParallelConfig(ep=2, pp=2)),
            (dirs["moe"], ParallelConfig(tp=2, ep=2))]
    assert len(list(dirs["untied"].glob("*.safetensors"))) >= 3  # a multi-file checkpoint
    res = run_ranks(_layout_logits, 4, jobs, timeout=600)
    for i, name in enumerate(["untied", "tied", "moe", "moe"]):
        got = [r[i] for r in res if r[i] is not None]
        assert got
        for g in got:
            close(g, hf_logits(refs[name]))


# ------------------------------------------------------------------ export
def train_and_export(tmp_path, src, par: ParallelConfig, *flags: str):
    """Train 2 steps from the HF model at ``src`` on 2 ranks of ``par``, save, ``fived export
    --hf`` (with ``flags``): (its model config, the checkpoint, the export folder)."""
    cfg = hf.model_config(hf.read_config(src, "--init-from"), seq_len=SEQ)
    ck = tmp_path / "ck"
    run_ranks(_train_and_save, 2, cfg, par,
              small_train(steps=2, global_batch=4, init_from=str(src), save_dir=str(ck)),
              timeout=600)
    out = tmp_path / "hf"
    r = run_cli("export", str(ck), "--hf", str(out), *flags)
    assert r.returncode == 0, r.stderr
    return cfg, ck, out


def check_export_is_trained(cfg, ck, out, src) -> None:
    """transformers' logits of the export equal fived's of the checkpoint, and differ from the
    source model's (the export holds the trained weights)."""
    from fived.checkpoint.convert import whole_model
    from fived.checkpoint.storage import read_manifest, resolve
    from fived.model import build_model

    ckpt = resolve(ck)
    model = build_model(cfg, 0)
    model.load_state_dict(whole_model(ckpt, read_manifest(ckpt)), strict=False)
    with torch.no_grad():
        mine = model(tokens(), torch.arange(SEQ)).numpy()
    trained = hf_logits(out)
    close(trained, mine)
    assert np.abs(trained - hf_logits(src)).max() > 1e-4


@pytest.mark.parametrize("kind", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_export_loads_in_transformers_with_fived_logits(tmp_path, kind):
    """Train 2 steps from an HF model (tp2 or ep2, ZeRO-1), export, load in transformers."""
    src = tmp_path / "src"
    make_hf(src, kind)
    par = ParallelConfig(tp=2, zero=1) if kind == "llama" else ParallelConfig(ep=2, zero=1)
    cfg, ck, out = train_and_export(tmp_path, src, par, "--max-shard-size", "40KB")
    files = sorted(out.glob("*.safetensors"))  # streamed shards of at most 40 kB (or 1 tensor)
    assert len(files) >= 3 and all(f.stat().st_size <= 40_000 + 8192 for f in files)  # + header
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(idx["weight_map"].values())) == [f.name for f in files]
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM" if kind == "llama"
                                     else "MixtralForCausalLM"]
    assert (out / "model.safetensors.index.json").is_file()
    check_export_is_trained(cfg, ck, out, src)


# ------------------------------------------------------------------ refusals
def test_hf_refusals(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        hf.read_config(tmp_path, "--init-from")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="another model family"):
        hf.model_config(hf.read_config(tmp_path, "--init-from"))
    from fived.config import PRESETS

    with pytest.raises(ConfigError, match="Qwen2-MoE has only shared_expert_gate = True"):
        hf.hf_config(replace(PRESETS["tiny-moe"], shared_expert=True))  # ungated: no family


def test_fused_transformers5_experts_are_read(tmp_path):
    """transformers 5's in-memory layout (fused gate_up_proj / down_proj, mlp.gate) maps back."""
    from safetensors.torch import save_file

    w1, w3, w2 = torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 4, 3)
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.cat([w1, w3], 1).contiguous(),
               "model.layers.0.mlp.experts.down_proj": w2,
               "model.layers.0.mlp.gate.weight": torch.randn(2, 4)},
              str(tmp_path / "model.safetensors"))
    src = hf.HFSource(tmp_path)
    assert torch.equal(src.read("layers.0.block_sparse_moe.experts.1.w3.weight"), w3[1])
    assert torch.equal(src.read("layers.0.block_sparse_moe.experts.0.w2.weight"), w2[0])
    assert "layers.0.block_sparse_moe.gate.weight" in src.tensors


# ------------------------------------------------------------------ the commands' bad input
def test_import_inspect_and_bad_input_exit_2(tmp_path, capsys):
    """fived import / checkpoint inspect work; each bad input is one error, exit 2, nothing
    overwritten (in-process: no ranks start)."""
    from fived.cli.main import main

    src = tmp_path / "hf"
    make_hf(src)
    ck = tmp_path / "ck"
    assert main(["import", str(src), "--save-dir", str(ck)]) == 0
    assert (ck / "step-000000" / "manifest.json").is_file()
    assert main(["checkpoint", "inspect", str(ck), "--files"]) == 0
    assert "step 0" in capsys.readouterr().out
    # an imported checkpoint (weights, no data position) resumes: it used to fail in every rank
    from fived.checkpoint.storage import resolve as _resolve
    from fived.config import ModelConfig as _MC

    man = json.loads((_resolve(ck) / "manifest.json").read_text())
    losses = run_ranks(_train_and_save, 1, _MC(**man["config"]["model"]), ParallelConfig(),
                       small_train(steps=1, global_batch=2, resume=str(_resolve(ck))))[0]
    assert len(losses) == 1 and np.isfinite(losses[0])

    def fails(argv, *words):
        before = sorted(p.name for p in tmp_path.rglob("*"))
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(w in err for w in words), err
        assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written

    fails(["import", str(src), "--save-dir", str(ck)], "already holds checkpoints")
    fails(["train", "--resume", str(tmp_path / "nope")], "no such directory")
    (tmp_path / "empty").mkdir()
    fails(["train", "--resume", str(tmp_path / "empty")], "no complete checkpoint")
    fails(["train", "--resume", str(src)], "Hugging Face model")
    fails(["train", "--init-from", str(tmp_path / "empty")], "no config.json")
    fails(["train", "--resume", str(ck), "--model", "tiny-moe"], "MoE")
    fails(["train", "--resume", str(ck), "--model", "tiny"],
          "layers.0.mlp.up_proj.weight: saved (48, 32), expected (176, 64)")
    fails(["export", str(ck), "--hf", str(src)], "not an empty directory")
    data = next((ck / "step-000000").glob("*.distcp"))
    with open(data, "r+b") as f:
        f.seek(10)
        f.write(b"\x00\x01")
    fails(["train", "--resume", str(ck)], data.name, "sha256")
    fails(["checkpoint", "inspect", str(ck), "--files"], data.name)


def test_init_from_bad_files_exit_2(tmp_path, capsys):
    """--init-from: an index naming a missing file, a tensor of the wrong shape: one error
    naming the file and tensor, exit 2, nothing written, no rank started."""
    import json as _json

    from safetensors.torch import load_file, save_file

    from fived.cli.main import main

    src = tmp_path / "hf"
    make_hf(src, shard="60KB")
    files = sorted(src.glob("*.safetensors"))
    before = sorted(p.name for p in tmp_path.rglob("*"))

    def fails(*words):
        assert main(["train", "--init-from", str(src), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(w in err for w in words), err
        assert sorted(p.name for p in tmp_path.rglob("*")) == before

    key = "model.layers.1.mlp.up_proj.weight"
    idx = _json.loads((src / "model.safetensors.index.json").read_text())
    home = src / idx["weight_map"][key]
    saved = load_file(str(home))
    save_file({**saved, key: saved[key][:-1].contiguous()}, str(home))
    fails("layers.1.mlp.up_proj.weight", home.name, "(47, 32)")
    save_file(saved, str(home))
    files[-1].rename(tmp_path / "away")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    fails(files[-1].name, "missing")
