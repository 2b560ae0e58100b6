"""``fived generate`` and its pieces (fived.model.cache, fived.infer): greedy tokens with the KV
cache equal a no-cache loop over the plain model and equal transformers' ``generate`` on small
random Llama and Mixtral models saved locally — on one rank and at tp2; a left-padded batch
gives each prompt what it gives alone; sampling is reproducible; the CLI end to end (a fived
checkpoint, tp1 and tp2 the same tokens) and its bad-input errors (exit 2, no traceback).
Only the tests that take the ``transformers`` fixture need transformers (skipped without it);
``fived bench generate``'s document is checked in tests/test_bench_schema.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fived.comm.ops import Traffic
from fived.config import ModelConfig, ParallelConfig, preset
from fived.infer.generate import Sampling, generate, pick
from fived.infer.model import inference_model
from fived.model import build_model
from fived.model.init import InitSource
from fived.ranks.grid import Grid
from fived.testing import run_ranks

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 32


def no_cache(model, prompt: list[int], n: int) -> list[int]:
    """The reference: the whole sequence through the plain forward for every new token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), torch.arange(len(ids)))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def one_rank(cfg: ModelConfig, source) -> torch.nn.Module:
    grid = Grid.from_config(ParallelConfig(), 0).connect(Traffic())
    return inference_model(cfg, grid, source, "cpu")


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_cache_equals_no_cache_and_batch_equals_alone(name):
    cfg = preset(name)
    model = build_model(cfg, 3).eval()
    batch = generate(model, PROMPTS, NEW)
    for r, p in enumerate(PROMPTS):
        alone = generate(model, [p], NEW).tokens[0]
        assert batch.tokens[r] == alone == no_cache(model, p, NEW), (name, r)
    # the cache: 2 · layers · b · slots · kv_heads · head_dim fp32 values
    slots = max(map(len, PROMPTS)) + NEW
    assert batch.cache_bytes == 2 * cfg.layers * 3 * slots * cfg.kv_heads * cfg.head_dim * 4
    assert batch.decode_steps == NEW - 1


def test_born_sharded_inference_model_equals_the_drawn_model():
    cfg = preset("tiny")
    ref = build_model(cfg, 5).eval()
    got = one_rank(cfg, InitSource(5, ref.param_std))
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), n
    assert not any(p.requires_grad for p in got.parameters())


def test_eos_stops_a_row_and_sampling_is_reproducible():
    model = build_model(preset("tiny"), 3).eval()
    greedy = generate(model, PROMPTS, NEW).tokens
    eos = greedy[0][3]
    cut = generate(model, PROMPTS, NEW, eos=eos).tokens
    assert cut[0] == greedy[0][:greedy[0].index(eos) + 1]
    s = Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=7)
    a, b = generate(model, PROMPTS, NEW, s).tokens, generate(model, PROMPTS, NEW, s).tokens
    assert a == b and a != greedy
    assert generate(model, PROMPTS, NEW, replace(s, seed=8)).tokens != a
    assert generate(model, PROMPTS, NEW, Sampling(1.0, top_k=1)).tokens == greedy


def test_pick_cuts_top_k_top_p_and_the_padded_vocab():
    z = torch.tensor([[0.0, 3.0, 2.9, -1.0, 5.0]])
    g = torch.Generator().manual_seed(0)
    seen = {int(pick(z, Sampling(1.0, top_k=2), g)) for _ in range(200)}
    assert seen == {1, 4}
    seen = {int(pick(z, Sampling(1.0, top_p=0.5), g)) for _ in range(200)}
    assert seen == {4}  # token 4 alone holds > 50 % of the mass
    assert int(pick(z[:, :4], Sampling(), None)) == 1  # greedy within the tokenizer's vocab


# ------------------------------------------------------------------ transformers parity
@pytest.fixture
def transformers():
    """transformers, or a skip of the tests that take this fixture (only those: the rest of the
    module runs without transformers)."""
    return pytest.importorskip("transformers")


SHAPE = dict(vocab_size=320, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, rope_theta=50000.0,
             rms_norm_eps=1e-6, max_position_embeddings=128)


def make_hf(transformers, path, kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    else:
        m = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **SHAPE, num_local_experts=4, num_experts_per_tok=2))
    m.save_pretrained(path)
    m.generation_config.eos_token_id = None  # 32 tokens whatever comes
    return m.eval()


def hf_greedy(m, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            y = m.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                           pad_token_id=0)
            out.append(y[0, len(p):].tolist())
    return out


def _tp_generate(rank: int, world: int, hf_dir: str) -> list[list[int]]:
    from fived.checkpoint import hf
    from fived.comm import ops

    cfg = hf.model_config(hf.read_config(hf_dir, "--hf"), "--hf", 128)
    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(Traffic())
    model = inference_model(cfg, grid, hf.HFSource(hf_dir, cfg, "--hf"), "cpu")
    return generate(model, PROMPTS, NEW,
                    gather=lambda z: ops.all_gather(z, grid["tp"], dim=-1)).tokens


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_greedy_equals_transformers_generate_on_one_rank_and_tp2(transformers, tmp_path, kind):
    from fived.checkpoint import hf

    ref = make_hf(transformers, tmp_path, kind)
    want = hf_greedy(ref, PROMPTS)
    cfg = hf.model_config(hf.read_config(tmp_path, "--hf"), "--hf", 128)
    model = one_rank(cfg, hf.HFSource(tmp_path, cfg, "--hf"))
    assert generate(model, PROMPTS, NEW).tokens == want
    assert [no_cache(model, p, NEW) for p in PROMPTS] == want
    for got in run_ranks(_tp_generate, 2, str(tmp_path)):
        assert got == want


# ------------------------------------------------------------------ the command
def fived(*args):
    """``fived ARGS`` in this process (``run_cli``: the subject is the command, not the
    interpreter; its ranks fork from the suite's pool)."""
    from parity_helpers import run_cli

    return run_cli(*map(str, args))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen") / "ck"
    r = fived("train", "--steps", 3, "--dp", 1, "--save-dir", d, "--save-every", 3)
    assert r.returncode == 0, r.stderr
    return d


def generate_args(ckpt) -> list:
    return ["generate", "--from", ckpt, "--prompt", "import os", "--prompt", "def f(x):",
            "--max-new-tokens", 12, "--temperature", 0, "--json"]


def test_cli_generates_from_a_checkpoint_at_tp1_and_tp2(ckpt):
    docs = []
    for tp in (1, 2):
        r = fived(*generate_args(ckpt), "--tp", tp)
        assert r.returncode == 0, r.stderr
        docs.append(json.loads(r.stdout))  # stdout is the JSON document alone
    assert [p["tokens"] for p in docs[0]["prompts"]] == [p["tokens"] for p in docs[1]["prompts"]]
    assert all(len(p["tokens"]) == 12 for p in docs[0]["prompts"])
    assert docs[1]["traffic_bytes"] > 0 and docs[0]["traffic_bytes"] == 0
    assert docs[1]["weights_bytes"] < docs[0]["weights_bytes"]
    r = fived("generate", "--from", ckpt, "--prompt", "import", "--max-new-tokens", 8)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("import") and "time to first token" in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def test_cli_generates_under_torchrun(ckpt):
    """Under torchrun the world is the tp degree and rank 0 prints: the tokens of one rank.

    Time: torchrun starts its agent and two interpreters (the subject is that launch)."""
    from test_torchrun import torchrun

    one = fived(*generate_args(ckpt), "--tp", 1)
    assert one.returncode == 0, one.stderr
    r = torchrun("-m", "fived", *map(str, generate_args(ckpt)))
    assert r.returncode == 0, r.stderr[-3000:]
    tr = json.loads(r.stdout)
    assert tr["tp"] == 2 and [p["tokens"] for p in tr["prompts"]] == [
        p["tokens"] for p in json.loads(one.stdout)["prompts"]]


def fails(*args, words):
    """``fived generate ARGS`` exits 2 with ``words`` in its message (no exception)."""
    r = fived("generate", *args)
    assert r.returncode == 2, (args, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and all(w in r.stderr for w in words), r.stderr


def test_cli_bad_input_exit_2(ckpt, tmp_path):
    from fived.data.tokenizer import train_bpe

    base = ["--from", ckpt]
    fails(*base, "--prompt", "x" * 60, words=["--max-new-tokens 64", "sequence length (64)"])
    fails(*base, "--prompt", "x" * 65, words=["longer than"])
    fails(*base, "--prompt", "", words=["--prompt", "empty"])
    fails(*base, "--tp", 3, "--prompt", "a", words=["--tp 3", "heads"])
    fails(*base, "--max-new-tokens", 0, "--prompt", "a", words=["--max-new-tokens"])
    fails("--from", tmp_path / "nothing", "--prompt", "a", words=["--from", "no such"])
    fails("--prompt", "a", words=["--from DIR"])
    tok = train_bpe(["some words to learn merges from, and some more words"] * 50, 300)
    tok.save(tmp_path / "tokenizer.json")
    fails(*base, "--tokenizer", tmp_path / "tokenizer.json", "--prompt", "some words",
          words=["outside the model's vocabulary"])
    assert not (tmp_path / "nothing").exists()


def test_cli_without_a_tokenizer_exit_2(transformers, tmp_path):
    """A Hugging Face directory, or a checkpoint imported from one, without a tokenizer."""
    from fived.checkpoint.convert import import_hf

    hf_dir = tmp_path / "hf"
    make_hf(transformers, hf_dir, "llama")
    fails("--hf", hf_dir, "--prompt", "a", words=["no tokenizer.json", "--tokenizer"])
    ck2, _, _ = import_hf(hf_dir, tmp_path / "imported")
    fails("--from", ck2, "--prompt", "a", words=["records no tokenizer", "--tokenizer"])
