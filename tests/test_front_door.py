"""The front door (issue 45): every mistyped command is one message that names its cause, exit 2,
no traceback, no rank started, every line within 80 columns; flags that would do nothing are
refused; a tampered checkpoint is refused before any rank; ``fived export`` writes the
tokenizer and ``fived generate --hf`` runs on it.

Every command runs in this process (``parity_helpers.run_cli``); the few that train fork their
ranks from the test run's pool. The table's rows were each seen to fail before the change that
made them pass (the messages it checks did not exist: "did you mean", the flag named first,
"and N more", the .metadata refusal).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import run_cli  # noqa: E402,I001


class _Evil:
    """A pickle that would run a shell command when loaded (what a tampered .metadata holds)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 2-step tiny checkpoint (dp 1, global batch 2), a tampered copy of it (its .metadata a
    pickle calling os.system, the manifest's sha256 recomputed to match), a prepared data
    directory, a full TOML of tiny (--print-config) and a plain file."""
    root = tmp_path_factory.mktemp("front")
    ck = root / "ck"
    r = run_cli("train", "--nprocs", "1", "--steps", "2", "--global-batch", "2",
                "--save-dir", str(ck))
    assert r.returncode == 0, r.stderr
    step = next(ck.glob("step-*"))
    evil = root / "evil"
    import shutil

    shutil.copytree(ck, evil)
    est = evil / step.name
    data = pickle.dumps(_Evil(str(root / "pwned")))
    (est / ".metadata").write_bytes(data)
    man = json.loads((est / "manifest.json").read_text())
    man["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (est / "manifest.json").write_text(json.dumps(man))
    notes = root / "notes"
    notes.mkdir()
    for i in range(120):
        (notes / f"n{i}.txt").write_text(f"def main_{i}():\n    return {i}\n" * 20)
    text = notes / "n0.txt"
    r = run_cli("data", "prepare", str(notes), "--out", str(root / "data"))
    assert r.returncode == 0, r.stderr
    toml = root / "tiny.toml"
    r = run_cli("train", "--tp", "2", "--print-config")
    toml.write_text(r.stdout)
    mixes = {"mixword": '"lots"', "mixzero": "0"}  # a [data] mixture: bad weights
    for key, weight in mixes.items():
        (root / f"{key}.toml").write_text(
            f'[data]\ncode = {{ dir = "{root / "data"}", weight = {weight} }}\n'
            f'web = {{ dir = "{root / "data"}", weight = 0 }}\n')
    mla = {}  # multi-head latent attention's bad fields (TOML-only)
    for key, body in (("mla_odd", "qk_rope_head_dim = 5"), ("mla_rank", "kv_lora_rank = 0")):
        mla[key] = root / f"{key}.toml"
        mla[key].write_text(f'[model]\nname = "deepseek-v3-tiny"\n{body}\n')
    mla["grouped"] = root / "grouped.toml"  # the experts' grouped matmuls, asked for by name
    mla["grouped"].write_text('[model]\nname = "tiny-moe"\nexpert_matmul = "grouped"\n')
    return {"ck": str(ck), "evil": str(evil), "data": str(root / "data"), "toml": str(toml),
            "file": str(text), "tmp": str(root), "pwned": root / "pwned",
            **{key: str(root / f"{key}.toml") for key in mixes},
            **{k: str(v) for k, v in mla.items()}}


# (command, what its message must say). {ck}, {evil}, {data}, {toml}, {file}, {tmp},
# {mixword}, {mixzero}, {mla_odd}, {mla_rank}: ``files``.
MISTYPES = [
    # unknown flags and choices: "did you mean", at most 3 lines of usage (argparse's own)
    ("train --stpes 5", "unknown flag --stpes; did you mean --steps?"),
    ("train --schedule zbv", "did you mean zb-v?"),
    ("train --zero 4", "--zero 4: did you mean 3? (one of 0, 1, 2, 3)"),
    ("trian", "did you mean train?"),
    ("train --precision bf61", "did you mean bf16?"),
    ("train --recompute ful", "did you mean full?"),
    ("train --optimizer adam", "did you mean adamw?"),
    ("train --cp-mode ulyses --cp 2", "did you mean ulysses?"),
    ("ledger --gpus 8 --modle llama3-8b", "unknown flag --modle; did you mean --model?"),
    ("plan --gpu-per-node 8", "did you mean --gpus-per-node?"),
    ("eval --form {ck}", "unknown flag --form; did you mean --from?"),
    ("generate --from {ck} --temprature 0", "did you mean --temperature?"),
    ("checkpoint inspekt {ck}", "did you mean inspect?"),
    ("data prepar {file}", "did you mean prepare?"),
    ("data prepare {file} --outt {tmp}/x", "unknown flag --outt; did you mean --out?"),
    ("checkpoint inspect {ck} --fils", "unknown flag --fils; did you mean --files?"),
    ("bench comms", "no bench named 'comms'; did you mean comm?"),
    ("figures scheduel", "no figures named 'scheduel'; did you mean schedule?"),
    ("train --model llama-7b", "--model llama-7b: no such preset; did you mean llama2-7b?"),
    ("ledger --gpu h100 --gpus 8", "--gpu h100: no such GPU; did you mean h100-sxm"),
    ("train --tp x", "argument --tp: invalid int value: 'x'"),
    ("train 5", "unexpected argument(s) 5"),
    # a layout that does not divide: the flag, the world, the values that fit
    ("train --tp 3 --nprocs 4", "--tp 3 (4 rank(s)): tiny's attention heads 4"),
    ("train --tp 3", "--tp can be 1, 2 or 4 for tiny"),
    ("ledger --model llama3-8b --gpus 8 --tp 3", "--tp can be 1, 2, 4 or 8 for llama3-8b"),
    ("train --seq-len 65 --cp 2", "seq_len must be divisible by 4; use --seq-len 64 or 68"),
    ("train --model tiny-moe --ep 3", "pick --ep from the divisors of 4 experts: 1, 2, 4"),
    # multi-head latent attention: the field named
    ("train --config {mla_odd}", "qk_rope_head_dim 5 must be even and > 0 for RoPE"),
    ("train --config {mla_rank}", "kv_lora_rank 0: q_lora_rank, qk_nope_head_dim, "
     "qk_rope_head_dim, v_head_dim are multi-head latent attention's"),
    ("train --model deepseek-v3-tiny --tp 3 --nprocs 3", "deepseek-v3-tiny's attention heads 4"),
    ("train --ep 2", "--ep 2 needs a MoE model"),
    ("train --pp 8", "pp·virtual_stages = 8 stages for 4 layers"),
    ("train --sequence-parallel", "--sequence-parallel needs --tp > 1"),
    ("train --mtp-depth 3 --seq-len 3", "mtp_depth 3 with --seq-len 3: module 3 predicts"),
    ("train --micro-batches 0", "--micro-batches must be >= 1"),
    ("train --dp 2 --global-batch 15", "global batch 15 is not divisible by dp·ep = 2"),
    ("train --dry-run --model llama3-405b --tp 8 --pp 16 --dp 64 --ranks distinct",
     "global batch 16 is not divisible by dp·ep = 64; use --global-batch 64"),
    ("train --timeout 0", "--timeout must be > 0"),
    ("train --preempt-signals TERM,KILL", "KILL is not a signal"),
    ("train --master-weights sr", "--master-weights sr: drops the fp32 master"),
    ("train --zero-align rows", "--zero-align rows: aligns ZeRO shards, but --zero 0"),
    ("train --fp8 tensorwise --precision fp16", "--fp8 tensorwise: fp8 products with fp16"),
    ("train --fp8 blockwise --tp 2", "--fp8 blockwise with --tp 2: a 128-wide tile would"),
    ("train --fp8 e4m3", "--fp8 e4m3: not one of none, tensorwise, rowwise, blockwise"),
    ("train --no-fp8-gather", "--no-fp8-gather: turns off ZeRO's fp8 all-gather"),
    ("plan --model tiny --gpus 2 --no-fp8-gather", "--no-fp8-gather: turns off ZeRO's fp8 "
     "all-gather of the searched layouts, but --fp8 is none"),
    ("train --fp8 rowwise --precision bf16 --zero 3 --dp 2 --pp 2 --no-fp8-gather",
     "--zero 3 --fp8 rowwise --pp 2 gathers nothing in fp8"),
    ("train --fp8 rowwise --precision bf16 --zero 2 --dp 2 --no-fp8-gather",
     "--zero 2 --fp8 rowwise gathers nothing in fp8"),
    ("train --fp8 blockwise --cp 2", "--fp8 blockwise with --cp 2: a 128-token tile of the"),
    ("train --config {grouped} --fp8 rowwise", "expert_matmul = grouped with --fp8 rowwise: the "
     "experts' fp8 products run as a loop"),
    ("bench numerics fp8 --stats-every -1", "--stats-every -1: a number of steps, 0 or more"),
    # flags that would do nothing here
    ("train --virtual-stages 2", "--virtual-stages 2 with --pp 1"),
    ("train --save-every 10", "--save-every 10: checkpoints go to --save-dir, and none is given"),
    ("train --keep 2", "--keep 2: checkpoints go to --save-dir"),
    ("train --schedule gpipe", "--schedule gpipe: orders a pipeline's micro-batches"),
    ("train --cp-mode ulysses", "--cp-mode ulysses: is how context parallelism splits"),
    ("train --cp 2 --cp-mode ring-latent", "--cp-mode ring-latent rotates MLA's latent; model "
     "tiny has no latent"),
    ("train --model deepseek-v3-tiny --cp 2 --cp-mode ring-latent --fp8 tensorwise",
     "--cp-mode ring-latent with --fp8 tensorwise: the latent ring's"),
    ("train --ep-dispatch tokens", "--ep-dispatch tokens: is how expert parallelism sends"),
    ("train --eval-batches 3", "--eval-batches 3: sizes the evaluation of --eval-every"),
    ("train --ranks 0", "--ranks 0: picks the ranks of a --dry-run; add --dry-run"),
    ("train --dry-run-device cpu", "--dry-run-device cpu: only a --dry-run uses it"),
    ("train --config {toml} --model small", "--model small and --config {toml}: the TOML's "
     "[model] section sets tiny's shape (hidden 64, layers 4"),
    ("train --config {mixword}", "[data] code.weight = 'lots'"),
    ("train --config {mixzero}", "[data] in {mixzero}: the weights sum to zero"),
    ("train --data code={data}:x", "source 'code''s weight 'x' is not a number"),
    ("train --data code={data}:0,web={data}:0", "the weights sum to zero"),
    ("plan --gpus 63 --model llama3-8b", "--gpus 63 is not a multiple of --gpus-per-node"),
    # missing inputs name the input
    ("data prepare nope.txt --out {tmp}/made/nope", "INPUT nope.txt: no such file or folder"),
    ("train --resume {tmp}/nothing", "no such directory"),
    ("train --resume auto", "--resume auto: resumes the newest checkpoint under --save-dir"),
    ("figures schedule --out {file}", "is a file, not a folder"),
    # a checkpoint of another model, other data, another seed: each side named
    ("train --resume {ck} --model small", "the checkpoint holds tiny (hidden 64, 4 layers, 4 "
     "heads, ffn 176, vocab 256); this run builds small (hidden 128, 8 layers"),
    ("train --resume {ck} --model tiny-moe", "a Llama-style dense model, tiny (hidden 64"),
    ("train --resume {ck} --data {data}", "trained on the built-in corpus (vocab 256), but "
     "--data {data} is other data"),
    ("train --resume {ck} --seed 3 --global-batch 2 --nprocs 1",
     "--seed 3: the checkpoint was trained with --seed 1234"),
    # a tampered checkpoint: one message naming the file, before anything loads it
    ("train --resume {evil}", ".metadata would run or import posix.system when loaded"),
    ("eval --from {evil} --data {data}", ".metadata would run or import posix.system"),
    ("export {evil} --hf {tmp}/evil-hf", ".metadata would run or import posix.system"),
    ("generate --from {evil} --prompt a --max-new-tokens 2", ".metadata would run or import"),
    ("checkpoint inspect {evil}", ".metadata would run or import posix.system"),
]
ARGPARSE = ("did you mean", "invalid int value", "unexpected argument")


def test_the_table_is_large():
    assert len(MISTYPES) >= 46, len(MISTYPES)


@pytest.mark.parametrize("command,says", MISTYPES, ids=[c for c, _ in MISTYPES])
def test_a_mistype_is_one_message_naming_its_cause(files, command, says):
    """Exit 2, the expected words, no traceback, no rank started, nothing run by a tampered
    checkpoint, every line within 80 columns; argparse's errors in at most 4 lines, usage in
    one of them.

    Time: the first row pays the module's fixture (a 2-step training in the pool, a data
    prepare): ~10 s on 2 quiet cores, 30 s loaded; every row after it is ~0.05 s."""
    import shlex

    argv = [a.format(**files) for a in shlex.split(command)]
    r = run_cli(*argv, no_rank=True)
    err = r.stderr
    assert r.returncode == 2, (command, r.returncode, r.stdout[-2000:], err)
    assert says.format(**files) in err, (command, err)
    assert "Traceback" not in err + r.stdout, err
    # within 80 columns, but a path the command was given (a word no fold may cut)
    wide = [line for line in (err + r.stdout).splitlines()
            if len(line) > 80 and files["tmp"] not in line]
    assert not wide, wide
    if any(w in says for w in ARGPARSE) and "no such preset" not in says \
            and "no such GPU" not in says and "named" not in says:
        assert len(err.splitlines()) <= 4 and err.count("usage:") == 1, err
    assert not files["pwned"].exists()


def test_resume_past_steps_exits_0_at_once(files):
    """--resume of a step-2 checkpoint with --steps 2: says so, exit 0, no rank started."""
    r = run_cli("train", "--resume", files["ck"], "--steps", "2", "--global-batch", "2",
                "--nprocs", "1", no_rank=True)
    assert r.returncode == 0, r.stderr
    assert "is at step 2, --steps 2 is reached already: nothing to train" in r.stdout


def test_a_resume_of_another_model_lists_five_then_the_rest(files):
    r = run_cli("train", "--resume", files["ck"], "--model", "small", no_rank=True)
    lines = [x for x in r.stderr.splitlines() if x.startswith("  - ")]
    # the models first, then 5 tensors, then "and N more" (75 differ: 70 more)
    assert "the checkpoint holds tiny" in lines[0] and len(lines) == 7, r.stderr
    assert lines[-1] == "  - and 70 more", lines


def test_the_metadata_scan_passes_real_checkpoints_and_refuses_globals(files):
    """A real .metadata names only allowed globals; the tampered one names posix.system; a
    truncated one does not parse (the reason is said)."""
    from fived.checkpoint.storage import check_metadata, unsafe_globals
    from fived.config import ConfigError

    real = next(Path(files["ck"]).glob("step-*")) / ".metadata"
    assert unsafe_globals(real.read_bytes()) == []
    evil = next(Path(files["evil"]).glob("step-*")) / ".metadata"
    assert unsafe_globals(evil.read_bytes()) == ["posix.system"]
    cut = Path(files["tmp"]) / "cut"
    cut.mkdir(exist_ok=True)
    (cut / ".metadata").write_bytes(real.read_bytes()[:100])
    with pytest.raises(ConfigError, match="does not parse"):
        check_metadata(cut)


def test_export_writes_the_tokenizer_and_generate_hf_runs_on_it(files, tmp_path):
    """``fived export`` of a checkpoint trained on the built-in corpus writes a tokenizer that
    transformers' AutoTokenizer loads with fived's byte ids; every file is mode 0644; greedy
    ``fived generate --hf`` of the export gives the text ``--from`` the checkpoint gives.
    Mutation: without the tokenizer files, ``generate --hf`` exits 2 ("no tokenizer.json")."""
    out = tmp_path / "hf"
    r = run_cli("export", files["ck"], "--hf", str(out))
    assert r.returncode == 0, r.stderr
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "config.json"} <= names, names
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.iterdir()), \
        [(p.name, oct(p.stat().st_mode)) for p in out.iterdir()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    text = "héllo € def main("
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 256
    args = ["--prompt", "def ", "--max-new-tokens", "6", "--temperature", "0", "--json"]
    a = run_cli("generate", "--hf", str(out), *args)
    b = run_cli("generate", "--from", files["ck"], *args)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    got = [json.loads(x.stdout)["prompts"][0] for x in (a, b)]
    assert got[0]["tokens"] == got[1]["tokens"] and len(got[0]["tokens"]) == 6, got
    assert got[0]["text"] == got[1]["text"], got


def test_figures_schedule_out_folder(tmp_path):
    """--out DIR writes into the folder (made when missing) and prints the real path."""
    folder = tmp_path / "figs"
    r = run_cli("figures", "schedule", "--out", str(folder), "--pp", "2", "--micro-batches", "4")
    assert r.returncode == 0, r.stderr
    made = list(folder.glob("*.png"))
    assert [p.name for p in made] == ["schedule-1f1b-p2-m4.png"], made
    assert f"figure: {made[0]}" in r.stdout
    assert not (tmp_path / "figs.png").exists()


def test_a_bpe_tokenizer_exports_for_autotokenizer(tmp_path):
    """A BPE trained by ``fived data prepare --train-bpe`` written as export writes it: the
    same ids and EOS through transformers' AutoTokenizer as through fived's own tokenizer."""
    from transformers import AutoTokenizer

    from fived.data.tokenizer import hf_files, train_bpe

    tok = train_bpe([f"def main_{i}(x):\n    return x * {i}\n" for i in range(200)], 300)
    for name, text in hf_files(tok, 128).items():
        (tmp_path / name).write_text(text)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    sample = "def main_7(x):\n    return x * 7\n"
    assert hf(sample)["input_ids"] == tok.encode_batch([sample])[0]
    assert hf.eos_token_id == tok.eos and hf.eos_token == "<|endoftext|>"


# ------------------------------------------------------------------ units and width
def test_bytes_are_binary_everywhere():
    """One formatter: the ledger's, the trainer's table and inspect's print the same text for
    the same bytes (issue 45: 457.18 MiB in train, 479.38 MB in inspect)."""
    from fived.ledger.memory import fmt_bytes
    from fived.train.metrics import human_bytes
    from fived.ui.report import fmt_b

    n = 479_380_000
    assert fmt_bytes(n) == human_bytes(n) == fmt_b(n) == "457.17 MiB"
    assert [fmt_bytes(x) for x in (0, 1023, 1024, 3 * 2**30, 5 * 2**40)] == [
        "0 B", "1023 B", "1.00 KiB", "3.00 GiB", "5.00 TiB"]


def test_ledger_validate_fits_80_columns_and_breaks_layouts_between_parts(capsys):
    """Every line within 80 columns; a layout that wraps breaks just after a "·" (issue 45:
    "rc-ful" / "l"). Mutation: the layout column with rich's fold wraps inside a part."""
    from fived.cli.main import main

    assert main(["ledger", "--validate"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(x) for x in lines) <= 80, [x for x in lines if len(x) > 80]
    head = next(x for x in lines if "layout" in x and "pub" in x)
    a, b = head.index("layout"), head.index("pub") - 1
    cells: list[list[str]] = []
    for x in lines[lines.index(head) + 2:]:
        if not x.strip() or x.startswith("median"):
            break
        cell = x[a:b].strip()
        if x[:a].strip():
            cells.append([cell])
        elif cell:
            cells[-1].append(cell)
    assert len(cells) >= 20
    wrapped = [c for c in cells if len(c) > 1]
    assert wrapped, "no layout wraps at 80 columns: the check checks nothing"
    for c in wrapped:
        assert all(piece.endswith("·") for piece in c[:-1]), c


def test_train_says_what_it_does_before_step_1():
    """Between the first line and step 1: spawning, the ranks up and building, built, the
    peak being measured (each printed as it starts, by the parent or rank 0). A process: what
    a rank prints reaches the terminal from the rank's own process (docs/testing.md).

    Time: one `fived train` process (an interpreter, torch imported twice, one rank, one
    step): ~10 s on quiet cores, 40 s loaded."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"}
    r = subprocess.run([sys.executable, "-m", "fived", "train", "--nprocs", "1", "--steps", "1",
                        "--global-batch", "1"], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    said = ["fived train:", "spawning 1 local rank(s)", "1 rank(s) up; building tiny",
            "built in", "measuring the matmul peak", "matmul peak", "step 1/1"]
    at = [out.find(s) for s in said]
    assert all(i >= 0 for i in at) and at == sorted(at), list(zip(said, at))
    assert all(len(x) <= 80 for x in out.splitlines()), out


def test_fp8_on_a_device_without_fp8_matmul_exits_2(monkeypatch):
    """--fp8 where torch._scaled_mm cannot run: one message, exit 2, before any rank."""
    from parity_helpers import cli_exits_2

    import fived.model.fp8 as fp8_mod

    monkeypatch.setattr(fp8_mod, "fp8_matmul_available", lambda device: False)
    out = cli_exits_2(["train", "--fp8", "rowwise", "--precision", "bf16"], "--fp8")
    assert "has no fp8 matmul" in out
