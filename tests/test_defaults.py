"""The defaults a GPU user expects (issue 30): --precision auto (bf16 on GPU hardware, fp32 on
the cpu, one rule, printed first), a ledger batch that grows with the cluster (plan's rule),
and `fived plan` reading a --config's cp_mode / bucket_mb / overlap / order (or refusing by
name what it cannot use)."""

import json

from fived.cli.main import main
from fived.config import AUTO, ParallelConfig, TrainConfig, resolve_precision
from fived.ledger.planner import cluster_batch


def test_resolve_precision_is_one_rule():
    assert ParallelConfig().precision == AUTO
    assert resolve_precision(ParallelConfig(), True, "h100-sxm") == (
        ParallelConfig(precision="bf16"), "precision bf16 (auto: h100-sxm)")
    assert resolve_precision(ParallelConfig(), False, "cpu")[0].precision == "fp32"
    for p in ("fp32", "bf16", "fp16"):  # explicit: unchanged, on any hardware
        par = ParallelConfig(precision=p)
        assert resolve_precision(par, True, "x") == (par, f"precision {p}")
        assert resolve_precision(par, False, "x") == (par, f"precision {p}")


def first_line(capsys, argv):
    assert main(argv) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_ledger_70b_on_64_h100_is_bf16_with_a_cluster_batch(capsys):
    """The first thing a planning user types: accepted, bf16, a GPU run's 4M-token batch in
    micro-batches of one sequence, and — plain dp64 does not fit — what was assumed, what to
    change and the plan command that finds a layout (issue 45, item 4)."""
    assert main(["ledger", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-sxm",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["precision_note"] == "precision bf16 (auto: h100-sxm)"
    assert doc["layout"]["precision"] == "bf16" and doc["global_batch"] == 512  # 4M tokens
    assert doc["layout"]["micro_batches"] == 8 and doc["micro_batch_size"] == 1
    assert "about 4M tokens" in doc["global_batch_note"]
    adv = doc["advice"]
    assert not doc["fits"]
    assert adv["assumed"][0] == "dp 64: the GPUs left of --gpus 64 by tp·cp·ep·pp = 1 (no --dp)"
    assert any(a.startswith("8 micro-batches of 1 sequence(s)") for a in adv["assumed"])
    from fived.ui.report import fmt_b

    mem = doc["memory"]
    assert adv["change"][0] == (f"it does not fit: the largest rank's step peaks at "
                                f"{fmt_b(mem['peak'])} of {fmt_b(doc['usable_memory'])} usable")
    assert mem["peak"] > 1e12  # plain dp64: every rank holds 18Ψ of 70B
    assert adv["change"][1].startswith(f"model states are {fmt_b(mem['states_total'])}: "
                                       "--zero 3 shards them")
    assert adv["plan"] == ("fived plan --model llama3-70b --gpus 64 --gpu h100-sxm "
                           "--global-batch 512")
    assert main(["ledger", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fived ledger: precision bf16 (auto: h100-sxm)")
    assert "global batch 512" in out and "what to change" in out
    assert out.rstrip().endswith(adv["plan"])


def test_ledger_pipeline_gets_micro_batches_and_its_bubble_named(capsys):
    """pp 16 without --micro-batches: one sequence each (32 per replica, not 1 and a 93.75 %
    bubble); the 32 % left is over the 25 % line, so the ledger says how to shrink it."""
    assert main(["ledger", "--model", "llama3-405b", "--gpus", "8192", "--tp", "8", "--pp",
                 "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["global_batch"] == 2048 and doc["layout"]["micro_batches"] == 32
    assert 0.25 < doc["time"]["bubble_fraction"] < 0.33
    bubble = [c for c in doc["advice"]["change"] if "bubble" in c]
    assert bubble and "--micro-batches of 4·pp = 64" in bubble[0]


def test_ledger_of_a_given_layout_that_fits_has_nothing_to_change(capsys):
    assert main(["ledger", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-sxm",
                 "--tp", "2", "--cp", "4", "--pp", "8", "--zero", "1", "--sequence-parallel",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["advice"]["change"] == []
    assert doc["time"]["bubble_fraction"] < 0.25
    # without --gpus: the ledger of what `fived train` runs, nothing assumed for a cluster
    assert main(["ledger", "--model", "tiny", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["advice"] == {"assumed": [], "change": [], "plan": ""}


def test_auto_is_fp32_on_this_machine_and_explicit_is_kept(capsys):
    here = first_line(capsys, ["ledger", "--gpu", "this-machine", "--print-config"])
    assert "precision fp32 (auto: this-machine)" in here
    line = first_line(capsys, ["ledger", "--model", "llama2-7b", "--gpus", "8",
                               "--precision", "fp32"])
    assert line.startswith("fived ledger: precision fp32 ·")
    assert "(auto" not in line
    assert "precision fp32 (auto: cpu)" in first_line(capsys, ["train", "--print-config"])
    plan = first_line(capsys, ["plan", "--model", "small", "--gpus", "4", "--top", "1"])
    assert plan.startswith("fived plan: precision bf16 (auto: h100-sxm)")


def test_print_config_round_trips_the_resolved_precision(capsys, tmp_path):
    assert main(["ledger", "--gpus", "8", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert 'precision = "bf16"' in text
    f = tmp_path / "c.toml"
    f.write_text(text)
    assert main(["ledger", "--config", str(f), "--print-config"]) == 0
    assert 'precision = "bf16"' in capsys.readouterr().out
    f.write_text('[parallel]\nprecision = "auto"\n')
    assert main(["ledger", "--config", str(f), "--gpu", "this-machine", "--print-config"]) == 0
    assert 'precision = "fp32"' in capsys.readouterr().out


def test_cluster_batch_is_plans_rule():
    assert cluster_batch(4, 16) == 16  # the training default up to 64 GPUs
    assert cluster_batch(64, 16) == 16 and cluster_batch(64, 16, 64) == 64
    assert cluster_batch(8192, 16) == 2048  # Llama 3's
    assert cluster_batch(128, 16, 24) == 48
    # the ledger on a GPU preset: about 4M tokens, or the GPUs' rule where that is more
    assert cluster_batch(64, 16, 1, 8192) == 512 and cluster_batch(64, 16, 1, 4096) == 1024
    assert cluster_batch(8192, 16, 1, 8192) == 2048 and cluster_batch(64, 16, 3, 8192) == 513
    assert TrainConfig().global_batch == 16


def test_ledger_keeps_a_given_batch(capsys):
    """A batch given (flag, tokens or TOML) is the user's: refused when dp does not divide it."""
    assert main(["ledger", "--model", "llama3-70b", "--gpus", "64", "--global-batch", "16"]) == 2
    assert "use --global-batch 64" in capsys.readouterr().err
    assert main(["ledger", "--model", "tiny", "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["global_batch"] == 16  # train's default


def plan_doc(capsys, tmp_path, toml: str, *extra):
    f = tmp_path / "p.toml"
    f.write_text(toml)
    assert main(["plan", "--model", "small", "--gpus", "8", "--config", str(f), "--top", "50",
                 "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_keeps_the_configs_fixed_keys(capsys, tmp_path):
    doc = plan_doc(capsys, tmp_path, '[parallel]\ncp_mode = "ulysses"\nbucket_mb = 5.0\n'
                   'overlap = false\norder = ["pp", "dp", "ep", "tp", "cp"]\n')
    assert doc["fixed"] == {"cp_mode": "ulysses", "bucket_mb": 5.0, "overlap": False,
                            "order": ["pp", "dp", "ep", "tp", "cp"]}
    assert doc["top"]
    for p in doc["top"]:
        par = p["parallel"]
        assert (par["cp_mode"], par["bucket_mb"], par["overlap"], par["order"]) == (
            "ulysses", 5.0, False, ["pp", "dp", "ep", "tp", "cp"])
    plain = plan_doc(capsys, tmp_path, "")
    assert plain["fixed"] == {} and plain["top"][0]["parallel"]["overlap"] is True


def test_plan_refuses_the_keys_it_cannot_use(tmp_path, capsys):
    f = tmp_path / "p.toml"
    f.write_text('[parallel]\nmaster_weights = "sr"\nprecision = "bf16"\n')
    assert main(["plan", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "[parallel] master_weights" in err and "fived plan" in err
    assert "Traceback" not in err
    f.write_text('[parallel]\norder = ["pp", "dp"]\n')
    assert main(["plan", "--config", str(f)]) == 2
    assert "--order" in capsys.readouterr().err
