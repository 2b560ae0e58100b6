"""The loader: a global batch is the same whatever the layout, an epoch visits every window
once, a stopped and resumed loader yields the same batches, and padded logits change nothing."""

import numpy as np
import pytest
import torch

from fived.config import ConfigError, ModelConfig, TrainConfig
from fived.data.loader import Loader
from fived.data.prepare import Options, prepare
from fived.data.shards import DataDir

L = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader")
    (d / "in").mkdir()
    for i in range(12):
        (d / "in" / f"{i:02d}.txt").write_text(f"doc {i} " + "abcdefgh" * (20 + 3 * i))
    prepare(Options((str(d / "in"),), str(d / "out"), val_fraction=0.25, workers=1),
            lambda s: None)
    return DataDir(d / "out")


def test_global_batch_is_the_same_whatever_the_layout(data):
    ref = Loader(data, "train", L, batch=8, seed=3)
    stream = np.asarray(data.tokens("train"), dtype=np.int64)
    for step in (0, 1, 7):
        gx, gy = ref.global_batch(step)
        for k, w in enumerate(ref.sequence_ids(step)):  # windows of the packed stream
            assert torch.equal(gx[k], torch.from_numpy(stream[w * L:w * L + L]))
            assert torch.equal(gy[k], torch.from_numpy(stream[w * L + 1:w * L + L + 1]))
        for replicas in (2, 4, 8):  # the batch group dp·ep: each reads its own rows only
            parts = [Loader(data, "train", L, 8, 3, r, replicas).batch(step)
                     for r in range(replicas)]
            assert torch.equal(torch.cat([p[0] for p in parts]), gx)
            assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_an_epoch_visits_every_window_once_and_the_seed_orders_it(data):
    ld = Loader(data, "train", L, batch=4, seed=3)
    n = ld.windows
    ids = np.concatenate([ld.sequence_ids(s) for s in range(-(-2 * n // 4))])
    assert sorted(ids[:n].tolist()) == list(range(n))  # epoch 0
    assert sorted(ids[n:2 * n].tolist()) == list(range(n))  # epoch 1, another order
    assert ids[:n].tolist() != ids[n:2 * n].tolist()
    other = Loader(data, "train", L, batch=4, seed=4)
    assert other.sequence_ids(0).tolist() != ld.sequence_ids(0).tolist()
    val = Loader(data, "val", L, batch=4, seed=3, shuffle=False)
    assert val.sequence_ids(1).tolist() == [(4 + j) % val.windows for j in range(4)]


def test_stopped_and_resumed_loader_yields_the_same_batches(data):
    a = Loader(data, "train", L, batch=4, seed=9, replica=1, replicas=2, prefetch=3)
    run = [a.get(s) for s in range(10)]
    a.close()
    b = Loader(data, "train", L, batch=4, seed=9, replica=1, replicas=2)
    resumed = [b.get(s) for s in range(6, 10)]  # a fresh loader, started at step 6
    b.close()
    for (x, y), (rx, ry) in zip(run[6:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    c = Loader(data, "train", L, batch=4, seed=9, replica=1, replicas=2)
    assert all(torch.equal(c.batch(s)[0], run[s][0]) for s in range(10))  # == no thread
    assert torch.equal(c.get(3)[0], run[3][0]) and torch.equal(c.get(8)[0], run[8][0])  # jumps
    c.close()


def test_masked_padding_leaves_loss_and_gradient_unchanged():
    from fived.data.vocab import MaskedLoss
    from fived.model.layers import TokenLoss

    torch.manual_seed(0)
    used, vocab = 300, 384
    logits = torch.randn(2, 5, vocab, requires_grad=True)
    targets = torch.randint(0, used, (2, 5))
    loss = MaskedLoss(TokenLoss(), used, vocab)(logits, targets)
    loss.backward()
    small = logits.detach()[..., :used].clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(small.reshape(-1, used), targets.reshape(-1),
                                            reduction="sum")
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-6)
    assert torch.allclose(logits.grad[..., :used], small.grad, atol=1e-7)
    assert torch.count_nonzero(logits.grad[..., used:]) == 0


def test_data_state_refuses_other_data(data, tmp_path):
    from fived.config import ParallelConfig
    from fived.train.trainer import Trainer

    model = ModelConfig(vocab=384, seq_len=L, layers=1, hidden=32, heads=2, kv_heads=1, ffn=64)
    train = TrainConfig(global_batch=4, steps=2, data=str(data.path))
    t = Trainer(model, ParallelConfig(), train, 0, 1)
    t.step(0)
    st = t.data_state()
    assert st["source"] == "data" and st["next_step"] == 1
    assert st["tokenizer_hash"] == data.tokenizer_hash
    t.load_data_state(dict(st, next_step=5))
    assert t.next_step == 5
    with pytest.raises(ConfigError, match="tokenizer_hash"):
        t.load_data_state(dict(st, tokenizer_hash="0" * 64))
    with pytest.raises(ConfigError, match="--seed"):
        t.load_data_state(dict(st, seed=1))
    with pytest.raises(ConfigError, match="source"):
        t.load_data_state({"source": "builtin", "corpus_mb": 4.0, "seed": 1234})
    t.close()
    b = Trainer(model, ParallelConfig(), TrainConfig(global_batch=4, steps=2), 0, 1)
    assert b.data_state() == {"source": "builtin", "corpus_mb": 4.0, "seed": 1234,
                              "global_batch": 4, "seq_len": L, "next_step": 0}
    with pytest.raises(ConfigError, match="--corpus-mb"):
        b.load_data_state(dict(b.data_state(), corpus_mb=8.0))
    with pytest.raises(ConfigError, match="model's vocab is 256"):
        Trainer(ModelConfig(seq_len=L), ParallelConfig(), train, 0, 1)


def test_bench_data_loader_outpaces_the_trainer(data):
    from fived.bench.data import parser, run

    args = parser().parse_args(["--data", str(data.path), "--batches", "30"])
    args.model, args.global_batch, args.steps, args.corpus_mb = "tiny", 8, 1, 4.0
    res = run(args, log=lambda s: None)
    assert res["loader_tokens_per_s"] > 0 and res["trainer_tokens_per_s"] > 0
    assert res["ratio"] >= 50 and res["ok"], res


def test_tensorboard_and_eval_records(data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fived.config import ParallelConfig
    from fived.train.trainer import train_rank

    model = ModelConfig(vocab=384, seq_len=L, layers=1, hidden=32, heads=2, kv_heads=1, ffn=64)
    train = TrainConfig(global_batch=4, steps=3, data=str(data.path), eval_every=2,
                        eval_batches=2, tensorboard=str(tmp_path / "tb"))
    out = train_rank(0, 1, model, ParallelConfig(), train, show=False, peak_flops=1e9)
    assert [s for s, _ in out["val"]] == [0, 1, 2]
    ev = EventAccumulator(str(tmp_path / "tb"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "speed/tokens_per_s", "speed/mfu",
                "memory/params", "memory/optimizer", "val/loss", "val/perplexity"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.value for e in ev.Scalars("val/loss")] == pytest.approx([v for _, v in out["val"]])
    assert [e.step for e in ev.Scalars("train/loss")] == [0, 1, 2]


def test_tensorboard_writes_bytes_per_dimension(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fived.train.tb import TensorBoard

    tb = TensorBoard(str(tmp_path))
    tb.log({"step": 4, "loss": 1.0, "traffic_per_rank": [
        {"bytes": {"tp": 10.0, "dense": 5.0, "metrics": 1.0}}, {"bytes": {"tp": 30.0}}]})
    tb.close()
    ev = EventAccumulator(str(tmp_path))
    ev.Reload()
    assert {"traffic/tp", "traffic/dense"} <= set(ev.Tags()["scalars"])
    assert "traffic/metrics" not in ev.Tags()["scalars"]
    assert ev.Scalars("traffic/tp")[0].value == 30.0  # the busiest rank's bytes
