"""Every optimizer under every layout equals the one-rank optimizer: the losses of k steps and
every parameter after them (gathered from the ranks' pieces to its global name and shape), to
1e-5 in fp32. Row/column statistics (Adafactor, RowNorm) and whole-matrix gathers (Muon) are
the parts that sharding could break: ZeRO's flat shards cut rows at arbitrary elements, tp cuts
rows (column-parallel) or columns (row-parallel), kv projections with tp > kv_heads are held by
two ranks each.

The default suite runs one spawn per world size with several layouts in it; the full matrix is
``slow``."""

from __future__ import annotations

from functools import cache

import pytest

from fived.config import OPTIMIZERS as CONFIG_OPTIMIZERS
from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.ledger.verify import compare_record
from fived.optim import OPTIMIZERS
from fived.testing import assemble_grads, rel_diff, run_ranks, small_train

TOL = 1e-5
# Parameters after k steps. AdamW under tp (the elementwise optimizer that was here before)
# measures 2.4e-5 on tp2: m/√v of elements whose gradient is near zero turns a 1e-7 gradient
# difference into an O(lr) step; the row/matrix optimizers normalise over whole rows or
# matrices and measure under 1.2e-6 on every layout.
PARAM_TOL = {"adamw": 5e-5}
STEPS = 4
TINY = preset("tiny")
MOE = preset("tiny-moe")


def _train(rank: int, world: int, runs: list[tuple]) -> list[dict]:
    """On one rank: train each (model, layout, train); the losses and this rank's master pieces
    after the last step (numpy, with their placements)."""
    from dataclasses import asdict

    from fived.train.trainer import Trainer

    out = []
    for m, p, t in runs:
        tr = Trainer(m, p, t, rank, world)
        recs = [tr.step(s) for s in range(t.steps)]
        losses = [r["loss"] for r in recs]
        params = tr.engine.full_params()
        pieces = {n: (asdict(tr.parallel.placements[n]), v.numpy()) for n, v in params.items()}
        mem = {k: int(v) for k, v in tr.engine.memory().items()}
        traffic = {k: v for k, v in tr.traffic.bytes_by_dim().items() if k != "metrics"}
        out.append({"losses": losses, "params": pieces, "memory": mem, "traffic": traffic,
                    "moe": recs[-1].get("moe")})  # the routing: exact ep bytes
    return out


def train_runs(runs: list[tuple]) -> list[dict]:
    world = runs[0][1].world_size
    per_rank = run_ranks(_train, world, runs, timeout=600)
    out = []
    for i in range(len(runs)):
        ranks = [per_rank[r][i] for r in range(world)]
        out.append({"losses": [r["losses"] for r in ranks],
                    "params": assemble_grads([r["params"] for r in ranks]),
                    "ranks": ranks})
    return out


@cache
def reference(model, opt: str) -> dict:
    return train_runs([(model, ParallelConfig(), small_train(optimizer=opt, steps=STEPS))])[0]


def check(out: dict, ref: dict, what: str, opt: str) -> None:
    for losses in out["losses"]:
        d = rel_diff(losses, ref["losses"][0])
        assert d < TOL, (what, "losses", d, losses, ref["losses"][0])
    worst = max((float((out["params"][n] - ref["params"][n]).norm()
                        / ref["params"][n].norm()), n) for n in ref["params"])
    assert worst[0] < PARAM_TOL.get(opt, TOL), (what, "params", worst)


def layouts_check(model, layouts: list[ParallelConfig], opts=OPTIMIZERS) -> None:
    runs_check([(model, p, small_train(optimizer=o, steps=STEPS)) for p in layouts for o in opts])


def runs_check(runs: list[tuple]) -> None:
    """Each (model, layout, train) equals one rank, and the ledger equals every rank."""
    for r in runs:
        validate(r[0], r[1], r[2])
    outs = train_runs(runs)
    for (m, p, t), out in zip(runs, outs):
        what = f"{t.optimizer} {p.describe()} {p.zero_align}"
        check(out, reference(m, t.optimizer), what, t.optimizer)
        ledger_check(m, p, t, out, what)


def ledger_check(m, p: ParallelConfig, t, out: dict, what: str) -> None:
    """The ledger's state bytes and traffic (with the optimizer's own terms) equal what every
    rank measured in its last step, to the byte."""
    rec = {"memory_per_rank": [r["memory"] for r in out["ranks"]],
           "traffic_per_rank": [{"bytes": r["traffic"]} for r in out["ranks"]],
           "moe": out["ranks"][0]["moe"]}
    bad = compare_record(m, p, t.global_batch, rec, optimizer=t.optimizer)
    assert not bad, (what, bad)


def test_optimizer_names_agree():
    assert CONFIG_OPTIMIZERS == OPTIMIZERS


def test_unknown_optimizer_and_bad_align_are_config_errors():
    with pytest.raises(ConfigError, match="optimizer"):
        validate(TINY, ParallelConfig(), small_train(optimizer="sgd"))
    with pytest.raises(ConfigError, match="zero-align"):
        validate(TINY, ParallelConfig(dp=2, zero_align="rows"), small_train())


def test_parity_world2_zero_shards_and_tp_cuts():
    """dp2 ZeRO-2 (shards cut rows and columns), dp2 ZeRO-3 aligned to rows, tp2 (column and
    row cuts) — every optimizer."""
    layouts_check(TINY, [ParallelConfig(dp=2, zero=2), ParallelConfig(dp=2, zero=3,
                                                                      zero_align="rows"),
                         ParallelConfig(tp=2)])


def test_zero3_with_pp_lays_chunks_out_as_the_ledger():
    """ZeRO-3 with pp gathers and shards whole pipeline chunks: the ledger's optimizer state
    (Muon's AdamW share depends on which shard holds the embedding; row alignment on the
    order of the rows) equals every rank's, and both equal one rank. The ledger once keyed
    these buckets by block (a traceback) and a chunk once put its layers before the embedding
    (Muon's shares swapped between the dp ranks)."""
    runs = [(TINY, ParallelConfig(pp=2, dp=2, zero=3), small_train(optimizer="muon",
                                                                   steps=STEPS)),
            (TINY, ParallelConfig(pp=2, dp=2, zero=3, zero_align="rows"),
             small_train(optimizer="rownorm", steps=STEPS))]
    runs_check(runs)


@pytest.mark.slow
@pytest.mark.parametrize("par", [
    ParallelConfig(dp=2), ParallelConfig(dp=2, zero=1), ParallelConfig(dp=2, zero=3),
    ParallelConfig(dp=2, zero=1, zero_align="rows"), ParallelConfig(pp=2),
    ParallelConfig(tp=2, sequence_parallel=True), ParallelConfig(cp=2),
    ParallelConfig(cp=2, zero=2)], ids=lambda p: f"{p.describe()}-{p.zero_align}")
def test_parity_world2_matrix(par):
    layouts_check(TINY, [par])


@pytest.mark.slow
@pytest.mark.parametrize("par", [
    ParallelConfig(tp=2, dp=2, zero=2), ParallelConfig(tp=4),  # tp4 > kv_heads 2
    ParallelConfig(pp=2, dp=2, zero=1), ParallelConfig(tp=2, pp=2)],
    ids=lambda p: p.describe())
def test_parity_world4_matrix(par):
    layouts_check(TINY, [par])


@pytest.mark.slow
@pytest.mark.parametrize("par", [ParallelConfig(ep=2), ParallelConfig(ep=2, zero=2),
                                 ParallelConfig(ep=2, dp=2, zero=1)], ids=lambda p: p.describe())
def test_parity_moe_matrix(par):
    layouts_check(MOE, [par])


def test_aligned_shards_fall_on_rows():
    """``--zero-align rows``: every boundary i·S lands on a whole row; S is the smallest such
    length ≥ ⌈numel/N⌉, and the padding it costs is what the ledger reports."""
    from fived.ledger.optimizers import aligned_shard_len

    sizes, rows = [64 * 176, 64, 176 * 64, 256 * 64], [64, 64, 176, 64]
    for n in (2, 3, 4, 8):
        S = aligned_shard_len(sizes, rows, n)
        assert S >= -(-sum(sizes) // n)
        offs = [0]
        for s in sizes:
            offs.append(offs[-1] + s)
        for i in range(1, n):
            x = i * S
            j = max(k for k in range(len(sizes)) if offs[k] <= x) if x < offs[-1] else None
            assert j is None or (x - offs[j]) % rows[j] == 0, (n, S, i)


def tiny_params() -> list[tuple[str, int, int]]:
    """(name, rows, columns) of every parameter of ``tiny`` as the model builds it, in its
    order (a 1-D parameter is one row)."""
    from fived.model.llama import Transformer

    model = Transformer(TINY)  # tiny: built in milliseconds (a meta device costs seconds here)
    return [(n, *((1, p.shape[0]) if p.dim() == 1 else p.shape)) for n, p in
            model.named_parameters()]


def ring_all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes  # bytes one rank sends: reduce-scatter + all-gather


def ring_all_gather(nbytes: float, n: int) -> float:
    return (n - 1) / n * nbytes  # nbytes: the gathered whole


def row_aligned_pad(params: list[tuple[str, int, int]], n: int) -> int:
    """Padding of one flat buffer of ``params`` cut into ``n`` equal shards whose boundaries
    fall on whole rows: the smallest shard S >= numel/n that does so, n·S − numel."""
    total = sum(r * c for _, r, c in params)
    S = -(-total // n)
    while True:
        starts, off = [], 0
        for _, r, c in params:
            starts.append((off, off + r * c, c))
            off += r * c
        if all(i * S >= total or any(lo <= i * S < hi and (i * S - lo) % c == 0
                                     for lo, hi, c in starts) for i in range(1, n)):
            return n * S - total
        S += 1


def test_ledger_optimizer_terms_measured_on_tiny():
    """The ledger's optimizer state and extra traffic on tiny (the numbers docs/optimizers.md
    quotes; the parity runs above check the same layouts' bytes against every rank) equal the
    optimizers' formulas, evaluated here on the model's own parameter shapes (R rows, C columns
    each, 4-byte fp32 statistics, dp2 or tp2, ring collectives)."""
    from fived.ledger.memory import model_states
    from fived.ledger.traffic import step_bytes

    def extra(par, o):
        a, b = step_bytes(TINY, par, 8, 0, "adamw"), step_bytes(TINY, par, 8, 0, o)
        return {k: b[k] - a.get(k, 0.0) for k in b if b[k] != a.get(k, 0.0)}

    ps = tiny_params()
    numel = sum(r * c for _, r, c in ps)
    sum_rows, sum_rc = sum(r for _, r, _ in ps), sum(r + c for _, r, c in ps)
    hidden = [(n, r, c) for n, r, c in ps if r > 1 and not n.startswith(("embed", "lm_head"))]
    assert numel % 2 == 0 and len(hidden) == 7 * TINY.layers  # q k v o gate up down per block
    z2, z3r, tp2 = (ParallelConfig(dp=2, zero=2), ParallelConfig(dp=2, zero=3, zero_align="rows"),
                    ParallelConfig(tp=2))
    assert extra(z2, "adamw") == {}
    # Adafactor: a row and a column second moment per matrix, whole on every ZeRO member,
    # all-reduced over dp each step
    assert model_states(TINY, z2, optimizer="adafactor")["optimizer"] == 4 * sum_rc
    assert extra(z2, "adafactor") == {"dense": ring_all_reduce(4 * sum_rc, 2)}
    # RowNorm: one moment per element, sharded; ZeRO cuts rows, so a statistic per row is
    # all-reduced -- unless the shards are aligned to rows
    assert model_states(TINY, z2, optimizer="rownorm")["optimizer"] == 4 * numel // 2
    assert extra(z2, "rownorm") == {"dense": ring_all_reduce(4 * sum_rows, 2)}
    assert extra(z3r, "rownorm") == {}
    # Muon under tp2: every hidden matrix is tp-cut and gathered whole for the orthogonalisation
    assert extra(tp2, "muon") == {"tp": ring_all_gather(4 * sum(r * c for _, r, c in hidden), 2)}
    # ZeRO-3 row-aligned: one buffer per block and one for the root (embedding, final norm,
    # head), each laid out in backward order; a rank holds 1/2 of the params, grads and AdamW's
    # two moments of its padding (fp32: 4 + 4 + 8 bytes an element)
    units = [[p for p in ps if p[0].startswith(f"layers.{i}.")] for i in range(TINY.layers)]
    units.append([p for p in ps if not p[0].startswith("layers.")])
    pad = sum(row_aligned_pad(list(reversed(u)), 2) for u in units)
    assert pad > 0 and model_states(TINY, z3r, optimizer="adamw")["padding"] == pad * 16 / 2


def test_plan_and_ledger_count_the_optimizer():
    """``predict(..., optimizer=)`` counts its state; ``plan`` with several optimizers evaluates
    each layout with each and names the optimizer in the layout."""
    from fived.ledger import planner
    from fived.ledger.hardware import get as hw_of

    m, par = preset("llama2-7b"), ParallelConfig(tp=8)
    hw = hw_of("h100-sxm")
    st = {o: planner.predict(m, par, hw, 8, optimizer=o).memory.states["optimizer"]
          for o in OPTIMIZERS}
    assert st["adafactor"] < st["rownorm"] < st["muon"] < st["adamw"]
    assert st["rownorm"] * 2 == st["adamw"]
    one = planner.plan(TINY, 2, hw, 8, zeros=(0,), recomputes=("none",))
    four = planner.plan(TINY, 2, hw, 8, zeros=(0,), recomputes=("none",), optimizer=OPTIMIZERS)
    assert four.counts["evaluated"] == 4 * one.counts["evaluated"]
    assert {p.optimizer for p in four.ranked} == set(OPTIMIZERS)
    assert any(p.name().endswith(" muon") for p in four.ranked)


def test_ledger_check_reads_the_runs_optimizer(tmp_path):
    """``fived ledger --check`` on a ``--metrics-out`` file of a Muon run: the file says which
    optimizer ran, and the ledger then agrees to the byte (AdamW's prediction would not)."""
    from fived.ledger.verify import compare_file, run_of_file
    from fived.train.trainer import train_rank

    out = tmp_path / "m.jsonl"
    train_rank(0, 1, TINY, ParallelConfig(), small_train(optimizer="muon", steps=2,
                                                          metrics_out=str(out)), show=False)
    m, par, gb = run_of_file(str(out))
    assert compare_file(m, par, gb, str(out)) == []
    rec = [__import__("json").loads(x) for x in out.read_text().splitlines()][-1]
    assert compare_record(m, par, gb, rec, optimizer="adamw")  # the wrong optimizer differs
