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


_REFERENCES: dict[tuple[ModelConfig, TrainConfig], dict[str, Any]] = {}


def one_rank(model: ModelConfig, train: TrainConfig) -> dict[str, Any]:
    """The one-rank reference, in this process (world 1 needs no process group), computed once
    per (model, training) for the whole test run and shared by every module that asks for it
    (treat it as read-only)."""
    from fived.testing import train_recording

    if (model, train) not in _REFERENCES:
        _REFERENCES[(model, train)] = gathered([train_recording(0, 1, model, ParallelConfig(),
                                                                train)])
    return _REFERENCES[(model, train)]


def check_parity(out: dict[str, Any], ref: dict[str, Any], what: Any = "") -> None:
    """Every rank's losses and the gathered first-step gradients equal the reference's."""
    assert len(ref["losses"]) >= 2
    for s in out["ranks"]:
        d = rel_diff(s["losses"], ref["losses"])
        assert d < TOL, (what, "losses", d, s["losses"], ref["losses"])
    g = grad_rel_diff(out["grads"], ref["grads"])
    assert g < TOL, (what, "gradients", g, worst_params(out["grads"], ref["grads"]))


def fp8_reference(model: ModelConfig, recipe: str, micro: int, train: TrainConfig
                  ) -> dict[str, Any]:
    """One rank under ``--fp8 recipe`` with fp32 around it (what every fp8 layout must equal)."""
    from fived.testing import train_recording

    par = ParallelConfig(precision="fp32", fp8=recipe, micro_batches=micro)
    return gathered([train_recording(0, 1, model, par, train)])


def check_close(out: dict[str, Any], ref: dict[str, Any], loss_tol: float, grad_tol: float,
                what: Any = "") -> tuple[float, float]:
    """``check_parity`` with its own tolerances (mixed precision against fp32): every rank's
    losses within ``loss_tol`` and the gathered first-step gradients within ``grad_tol`` of the
    reference's. Returns the worst (loss, gradient) gaps, to report the measured numbers."""
    assert len(ref["losses"]) >= 2
    dl = max(rel_diff(s["losses"], ref["losses"]) for s in out["ranks"])
    assert dl < loss_tol, (what, "losses", dl, out["losses"], ref["losses"])
    g = grad_rel_diff(out["grads"], ref["grads"])
    assert g < grad_tol, (what, "gradients", g, worst_params(out["grads"], ref["grads"]))
    return dl, g


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

        return one_rank(model, small_train())

    def __call__(self, pairs: list[tuple[ModelConfig, ParallelConfig]]) -> list[dict[str, Any]]:
        from fived.testing import small_train

        by_world: dict[int, list] = {}
        for m, p in pairs:
            if (m, p) not in self.cache and (m, p) not in by_world.get(p.world_size, []):
                by_world.setdefault(p.world_size, []).append((m, p))
        for group in by_world.values():
            self.cache.update(zip(group, train_runs([(m, p, small_train()) for m, p in group])))
        return [self.cache[mp] for mp in pairs]


class Words(str):
    """A command's output, where ``phrase in out`` also matches across the line breaks the
    command folds its messages at (80 columns, ``fived.ui.report.fold``): the same words in
    the same order, any whitespace between them."""

    def __contains__(self, phrase: object) -> bool:
        if not isinstance(phrase, str):
            return False
        return (str.__contains__(self, phrase)
                or " ".join(phrase.split()) in " ".join(self.split()))


class CliResult:
    """What ``run_cli`` saw: the exit status and the two streams (``Words``)."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, Words(stdout), Words(stderr)


def run_cli(*argv: str, no_rank: bool = False) -> CliResult:
    """``fived ARGV`` in this process (the subject is the command's parsing and output, not the
    process: ``python -m fived`` costs an interpreter and a torch import, ~5 s here). An
    exception propagates (a traceback fails the test). ``no_rank``: starting a rank fails."""
    import contextlib
    import io
    from unittest import mock

    from fived.cli.main import main

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError(f"fived {' '.join(argv)}: a rank was started")

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if no_rank:
            stack.enter_context(mock.patch("fived.ranks.launch.run_local", refuse))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse's own errors and --help
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return CliResult(int(rc or 0), out.getvalue(), err.getvalue())


EXACT_STATES = "exact: every rank's model-state bytes and traffic bytes"


def dry_run_is_exact(tmp_path: Any, *argv: str) -> CliResult:
    """``fived train --dry-run ARGV --steps 1 --metrics-out F``, then ``fived ledger --check
    F``: the dry run succeeds and every rank's model-state and traffic bytes are the ledger's
    exactly. The check's result (for the caller's further asserts)."""
    out = tmp_path / "run.jsonl"
    r = run_cli("train", "--dry-run", *argv, "--steps", "1", "--metrics-out", str(out))
    assert r.returncode == 0, r.stderr
    c = run_cli("ledger", "--check", str(out))
    assert EXACT_STATES in c.stdout, c.stdout
    return c


def cli_exits_2(argv: list[str], field: str, written: Any = None) -> str:
    """``fived ARGV`` in this process: exit 2, one message on stderr naming ``field``, no
    traceback, no rank started, nothing at ``written``. The error message."""
    r = run_cli(*argv, no_rank=True)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert field in r.stderr, r.stderr
    assert "rank" not in r.stdout.lower(), r.stdout
    assert written is None or not written.exists(), written
    return r.stderr


def bad_moe_config_exits_2(tmp_path: Any, body: str, field: str, *flags: str) -> None:
    """``fived train`` on a qwen3-moe-tiny --config with ``body`` added under [model] (and
    ``flags``): ``cli_exits_2`` naming ``field``."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[model]\nname = "qwen3-moe-tiny"\n{body}\n')
    cli_exits_2(["train", "--config", str(cfg), "--nprocs", "2", "--ep", "2", "--metrics-out",
                 str(tmp_path / "m"), *flags], field, tmp_path / "m")
