"""The suite's one pool of ranks: every multi-rank test forks its ranks from one server that
imported torch and fived once (``fived.ranks.launch.use_forkserver``), instead of spawning
interpreters that import them again (~0.2 s for 4 ranks against ~10 s spawned on 2 cores). A
test that needs new interpreters passes ``fresh=True`` to ``run_local`` or runs a subprocess."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from fived.ranks.launch import use_forkserver  # noqa: E402 - after OMP_NUM_THREADS

# what a rank's function needs; a test module that imports transformers at its top is imported
# by every rank that runs one of its functions, so rank functions live elsewhere
PRELOAD = ("torch", "torch.distributed", "fived.testing", "fived.train.trainer",
           "fived.train.dryrun", "fived.checkpoint.state", "fived.infer.generate")

use_forkserver(PRELOAD)


# ------------------------------------------------------------------ messages folded at 80 columns
# fived folds its messages between words at 80 columns (fived.ui.report.fold); what capsys
# reads is ``parity_helpers.Words``, where ``phrase in err`` matches across those line breaks
# (the same words in the same order), as ``run_cli``'s streams do.
def _words_readouterr():
    import _pytest.capture as capture
    from parity_helpers import Words

    plain = capture.CaptureFixture.readouterr

    def readouterr(self):
        r = plain(self)
        return capture.CaptureResult(Words(r.out), Words(r.err))

    capture.CaptureFixture.readouterr = readouterr


_words_readouterr()


# ------------------------------------------------------------------ the suite's time budget
# A default-suite test over BUDGET_S (setup + call) says why in its docstring, in a line that
# starts with "Time:", or moves to `slow` with a fast sibling. Printed in the summary, not an
# assertion: a wall-clock bound fails on a loaded machine, and a clock is no test.
BUDGET_S = 20.0
_spent: dict[str, float] = {}
_reasoned: set[str] = set()


# (under pytest-xdist the workers collect and the controller sums: the reason travels with each
# report as a user property)
def pytest_collection_modifyitems(items):
    for item in items:
        doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
        if any(line.strip().startswith("Time:") for line in doc.splitlines()):
            item.user_properties.append(("time_reason", True))


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _spent[report.nodeid] = _spent.get(report.nodeid, 0.0) + report.duration
        if dict(report.user_properties).get("time_reason"):
            _reasoned.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    over = sorted(((s, n) for n, s in _spent.items() if s > BUDGET_S and n not in _reasoned),
                  reverse=True)
    if over:
        terminalreporter.section(f"over the {BUDGET_S:.0f} s budget, no 'Time:' reason")
        for s, n in over:
            terminalreporter.write_line(f"{s:6.1f} s  {n}")
