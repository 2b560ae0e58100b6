"""Configs: presets, validation that names every broken constraint, TOML in and out."""

from dataclasses import replace

import pytest

from fived.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    dump_toml,
    load_toml,
    preset,
    validate,
)


def test_presets_exist():
    for name in ("tiny", "tiny-moe", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b",
                 "mixtral-8x7b"):
        m = preset(name)
        assert m.hidden % m.heads == 0


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("gpt-17")


def test_valid_layout_passes():
    validate(preset("tiny"), ParallelConfig(tp=2, dp=2), TrainConfig(), world_size=4)


def test_every_problem_is_listed():
    par = ParallelConfig(tp=3, pp=3, cp=5, ep=2)
    with pytest.raises(ConfigError) as e:
        validate(preset("tiny"), par, TrainConfig(global_batch=15), world_size=4)
    text = str(e.value)
    for needle in ("world size 4", "heads", "layers over pp", "seq_len over 2·cp", "needs a MoE",
                   "global batch"):
        assert needle in text, needle
    assert len(e.value.problems) >= 6


def test_world_size_hint():
    with pytest.raises(ConfigError, match="use --dp 4"):
        validate(preset("tiny"), ParallelConfig(tp=2, dp=1), None, world_size=8)


def test_gqa_replication_rule():
    m = replace(preset("tiny"), heads=8, kv_heads=2)
    validate(m, ParallelConfig(tp=4), None, 4)  # 4 > 2 kv heads, 4 % 2 == 0: replicate
    m3 = replace(preset("tiny"), hidden=96, heads=6, kv_heads=2, ffn=192)
    with pytest.raises(ConfigError, match="multiple of kv_heads"):
        validate(m3, ParallelConfig(tp=3), None, 3)


def test_micro_batches_divide_replica_batch():
    with pytest.raises(ConfigError, match="micro-batches"):
        validate(preset("tiny"), ParallelConfig(dp=2, micro_batches=3), TrainConfig(global_batch=8))


def test_toml_round_trip(tmp_path):
    m = replace(preset("llama3-8b"), seq_len=2048)
    par = ParallelConfig(tp=8, pp=4, dp=2, zero=1, schedule="interleaved", virtual_stages=2,
                         micro_batches=8, pp_layers=())
    tr = TrainConfig(model="llama3-8b", steps=7, lr=1e-4)
    f = tmp_path / "run.toml"
    f.write_text(dump_toml(m, par, tr))
    m2, par2, tr2 = load_toml(f)
    assert (m2, par2, tr2) == (m, par, tr)


def test_toml_preset_with_override(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text('[model]\nname = "tiny"\nlayers = 2\n[parallel]\ndp = 2\n[train]\nsteps = 3\n')
    m, par, tr = load_toml(f)
    assert m.layers == 2 and m.hidden == ModelConfig().hidden and par.dp == 2 and tr.steps == 3


def test_toml_unknown_key(tmp_path):
    f = tmp_path / "b.toml"
    f.write_text("[parallel]\ntensor = 2\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_toml(f)
