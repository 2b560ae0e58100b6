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
    with pytest.raises(ConfigError, match="no such preset"):
        preset("gpt-17")


def test_valid_layout_passes():
    validate(preset("tiny"), ParallelConfig(tp=2, dp=2), TrainConfig(), world_size=4)


def test_every_problem_is_listed():
    par = ParallelConfig(tp=3, pp=5, cp=5, ep=2)  # pp 5 > 4 layers (any pp <= layers splits)
    with pytest.raises(ConfigError) as e:
        validate(preset("tiny"), par, TrainConfig(global_batch=15), world_size=4)
    text = str(e.value)
    for needle in ("world size 4", "heads", "each stage needs a layer", "zigzag split",
                   "needs a MoE",
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


# ------------------------------------------------------------------ bounds, world, outputs
def test_values_are_checked_first_and_name_the_flag():
    from fived.config import check_values

    # micro_batches 0 used to reach a modulo by zero inside validate
    with pytest.raises(ConfigError, match="--micro-batches must be >= 1"):
        validate(preset("tiny"), ParallelConfig(micro_batches=0), TrainConfig())
    bad = TrainConfig(lr=-1, min_lr_ratio=1.5, beta1=1.0, eps=0, warmup=-1, grad_clip=-1,
                      weight_decay=-1, corpus_mb=0, steps=0, global_batch=0, log_every=0)
    text = "\n".join(check_values(train=bad))
    for needle in ("--lr must be > 0", "--min-lr-ratio must be in [0, 1]", "--beta1 must be in [0, 1)",
                   "--eps must be > 0", "--warmup must be >= 0", "--grad-clip must be >= 0",
                   "--weight-decay must be >= 0", "--corpus-mb must be > 0", "--steps must be >= 1",
                   "--global-batch must be >= 1", "--log-every must be >= 1"):
        assert needle in text, needle
    par = ParallelConfig(tp=0, zero=4, bucket_mb=0, schedule="2f2b", order=("pp", "dp"))
    text = "\n".join(check_values(par=par))
    for needle in ("--tp must be >= 1", "--zero 4", "--bucket-mb must be > 0", "--schedule '2f2b'",
                   "--order"):
        assert needle in text, needle
    # a TOML-only field is named by its table and key
    assert check_values(model=replace(preset("tiny"), layers=0)) == [
        "[model] layers must be >= 1 (got 0)"]
    assert "must be an integer" in check_values(par=ParallelConfig(tp=2.5))[0]


def test_fill_dp():
    from fived.config import fill_dp

    assert fill_dp(ParallelConfig(), False) == (ParallelConfig(dp=4), 4)  # fived train, nothing
    assert fill_dp(ParallelConfig(tp=2), False) == (ParallelConfig(tp=2, dp=2), 4)
    assert fill_dp(ParallelConfig(tp=8), False) == (ParallelConfig(tp=8), 8)
    assert fill_dp(ParallelConfig(tp=2), False, 8) == (ParallelConfig(tp=2, dp=4), 8)
    assert fill_dp(ParallelConfig(dp=3), True) == (ParallelConfig(dp=3), 3)  # given: kept
    assert fill_dp(ParallelConfig(dp=1), True, 4) == (ParallelConfig(dp=1), 4)  # validate names it
    assert fill_dp(ParallelConfig(tp=0), False)[1] is None


def test_read_toml_says_what_it_gave(tmp_path):
    from fived.config import read_toml

    f = tmp_path / "a.toml"
    f.write_text("[parallel]\ndp = 1\n[train]\nsteps = 3\n")
    _, par, tr, given = read_toml(f)
    assert par.dp == 1 and tr.steps == 3 and given == {"parallel.dp", "train.steps"}
    f.write_text("[parallel]\ntp = 0\n")
    _, par, _, _ = read_toml(f)
    with pytest.raises(ConfigError, match="--tp must be >= 1"):
        validate(preset("tiny"), par)


def test_check_outputs(tmp_path):
    from fived.config import check_outputs

    check_outputs(TrainConfig())
    check_outputs(TrainConfig(metrics_out=str(tmp_path / "m.jsonl")))
    with pytest.raises(ConfigError, match="--metrics-out .* does not exist"):
        check_outputs(TrainConfig(metrics_out=str(tmp_path / "no" / "m.jsonl")))
    assert list(tmp_path.iterdir()) == []
