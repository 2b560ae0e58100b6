"""Loss *and* gradient parity against the one-rank reference, shared by the layout tests.

Every parity test compares two things with the one-rank run of the same model and training:
the losses of every step (every rank's copy) and the full first-step gradient of every
parameter, gathered from all ranks' pieces to its global name and shape
(``fived.testing.assemble_grads``; replicas must agree exactly). ``train_runs`` trains several
layouts of one world size in one spawn (``fived.testing.train_runs``, re-exported here with
``rank_runs`` and ``gathered``), keeping every rank's history (traffic, MoE statistics).
"""

from __future__ import annotations

from typing import Any

from fived.config import ModelConfig, ParallelConfig, TrainConfig
from fived.testing import gathered, grad_rel_diff, rank_runs, rel_diff, train_runs  # noqa: F401

TOL = 1e-5


def offline_grid(par: ParallelConfig, rank: int):
    """Rank ``rank``'s grid with every group it is in but no process group, for cutting a model
    in this process (``parallelize_parts`` talks to no one). No process group is initialised
    here, so a collective on it would fail, not go to the world. A one-rank layout can simply
    ``connect`` instead."""
    from fived.ranks.grid import DimGroup, Grid

    grid = Grid.from_config(par, rank)
    for name in grid.group_names():
        members = grid.members(Grid.named_dims(name))
        grid.groups[name] = DimGroup(name, members, members.index(rank), None, None)
    return grid


def one_rank(model: ModelConfig, train: TrainConfig) -> dict[str, Any]:
    """The one-rank reference, in this process (world 1 needs no process group)."""
    from fived.train.trainer import train_rank

    return gathered([train_rank(0, 1, model, ParallelConfig(), train, show=False,
                                record_grads=True)])


def check_parity(out: dict[str, Any], ref: dict[str, Any], what: Any = "") -> None:
    """Every rank's losses and the gathered first-step gradients equal the reference's."""
    assert len(ref["losses"]) >= 2
    for s in out["ranks"]:
        d = rel_diff(s["losses"], ref["losses"])
        assert d < TOL, (what, "losses", d, s["losses"], ref["losses"])
    g = grad_rel_diff(out["grads"], ref["grads"])
    assert g < TOL, (what, "gradients", g, worst_params(out["grads"], ref["grads"]))


def check_moe_parity(out: dict[str, Any], ref: dict[str, Any], what: Any = "") -> None:
    """``check_parity``, and every step's grad norm, aux and z losses (1e-5) and tokens per
    expert (exactly) equal the reference's; the reference's loss fell."""
    check_parity(out, ref, what)
    for s in out["ranks"]:
        for h, hr in zip(s["history"], ref["ranks"][0]["history"]):
            assert rel_diff([h["grad_norm"]], [hr["grad_norm"]]) < 1e-5
            assert rel_diff([h["moe"]["aux_loss"], h["moe"]["z_loss"]],
                            [hr["moe"]["aux_loss"], hr["moe"]["z_loss"]]) < 1e-5
            assert h["moe"]["tokens_per_expert"] == hr["moe"]["tokens_per_expert"]
    assert ref["losses"][-1] < ref["losses"][0]


def worst_params(a: dict[str, Any], ref: dict[str, Any], n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` parameters whose gradients differ most (relative), for failure messages."""
    d = {k: float((a[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref if k in a}
    return sorted(d.items(), key=lambda kv: -kv[1])[:n]


class SessionRuns:
    """Trains each (model, layout) with ``small_train()`` once per test session, the layouts of
    one world size in one spawn; ``one_rank(model)`` is the reference, computed once."""

    def __init__(self):
        self.cache: dict = {}

    def one_rank(self, model: ModelConfig) -> dict[str, Any]:
        from fived.testing import small_train

        if ("one", model) not in self.cache:
            self.cache[("one", model)] = one_rank(model, small_train())
        return self.cache[("one", model)]

    def __call__(self, pairs: list[tuple[ModelConfig, ParallelConfig]]) -> list[dict[str, Any]]:
        from fived.testing import small_train

        by_world: dict[int, list] = {}
        for m, p in pairs:
            if (m, p) not in self.cache and (m, p) not in by_world.get(p.world_size, []):
                by_world.setdefault(p.world_size, []).append((m, p))
        for group in by_world.values():
            self.cache.update(zip(group, train_runs([(m, p, small_train()) for m, p in group])))
        return [self.cache[mp] for mp in pairs]


def cli_exits_2(argv: list[str], field: str, written: Any = None) -> str:
    """``fived ARGV`` in this process: exit 2, one message on stderr naming ``field``, no
    traceback (an exception would propagate here), no rank started (``run_local`` is replaced
    by one that fails), nothing at ``written``. The error message."""
    import contextlib
    import io
    from unittest import mock

    from fived.cli.main import main

    def no_rank(*a: Any, **k: Any) -> None:
        raise AssertionError(f"fived {' '.join(argv)}: a rank was started")

    out, err = io.StringIO(), io.StringIO()
    with mock.patch("fived.ranks.launch.run_local", no_rank), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own errors
            rc = e.code
    assert rc == 2, (rc, out.getvalue(), err.getvalue())
    assert field in err.getvalue(), err.getvalue()
    assert "rank" not in out.getvalue().lower(), out.getvalue()
    assert written is None or not written.exists(), written
    return err.getvalue()


def bad_moe_config_exits_2(tmp_path: Any, body: str, field: str, *flags: str) -> None:
    """``fived train`` on a qwen3-moe-tiny --config with ``body`` added under [model] (and
    ``flags``): ``cli_exits_2`` naming ``field``."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[model]\nname = "qwen3-moe-tiny"\n{body}\n')
    cli_exits_2(["train", "--config", str(cfg), "--nprocs", "2", "--ep", "2", "--metrics-out",
                 str(tmp_path / "m"), *flags], field, tmp_path / "m")
