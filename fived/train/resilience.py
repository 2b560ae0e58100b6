"""What keeps a long run going without a person (docs/checkpoints.md, "Runs that recover").

* ``Preemption`` — ``--preempt-signals`` (default TERM,USR1): the handler only sets a flag; every
  step the ranks agree on it without a collective of its own: each rank's vote (1 if a signal
  reached it) rides as a second element of the step's loss all-reduce, which sums over the
  whole world (``Trainer.global_loss``), so a signal that reached any one rank makes every rank
  save after the same step and leave with status 75 (``PREEMPTED_EXIT``: preempted,
  resumable). Bound: the rest of the step in flight — or, for a signal that arrives after that
  step's loss was reduced, the next step too — plus the save.
* ``BadSteps`` — a step whose loss or global gradient norm is not finite is skipped (the
  engine makes no update; both values are global, so every rank skips the same step); after
  ``--max-bad-steps`` in a row the run stops with a message and saves nothing more, so the
  last good checkpoint stays the newest.
* ``History`` — what ``train_rank`` keeps of the steps: the last ``WINDOW`` records (the final
  table's medians and the tests' per-step checks), running totals, every loss as 8 bytes
  (``array('d')``); ``--metrics-out`` still gets every record.
"""

from __future__ import annotations

import math
import signal
from array import array
from collections import deque
from typing import Any

from ..config import preempt_signal_names

WINDOW = 256  # the records train_rank keeps (medians of the final table)


class Preemption:
    """Catch ``names`` (e.g. ["TERM", "USR1"]) on this rank; ``vote()`` goes into the step's loss
    all-reduce, ``count(votes)`` takes the world's sum back, ``agreed()`` reads it."""

    def __init__(self, spec: str):
        self.hit: str | None = None
        self.votes = 0.0  # the world's votes counted in the last step
        self.old: dict[int, Any] = {}
        names, _ = preempt_signal_names(spec)
        self.active = bool(names)  # the same on every rank: --preempt-signals '' costs nothing
        for n in names:
            sig = getattr(signal, f"SIG{n}")
            try:
                self.old[sig] = signal.signal(sig, self._on)
            except ValueError:  # not the main thread (a test calling train_rank in a thread)
                break

    def _on(self, signum: int, frame: Any) -> None:
        # a second signal changes nothing: under SLURM + torchrun a rank gets SIGTERM from
        # slurmstepd and again from its torchrun agent, and must still save (torchrun
        # SIGKILLs it after its own grace period)
        self.hit = signal.Signals(signum).name

    def vote(self) -> float:
        """This rank's vote: 1.0 once a signal reached it."""
        return 1.0 if self.hit else 0.0

    def count(self, votes: float) -> None:
        """The votes of every rank, summed (the same number on every rank)."""
        self.votes = votes

    def agreed(self) -> bool:
        """True on every rank when a signal reached any rank by the time the last step's loss
        was reduced (no collective: the count came with the loss)."""
        return self.active and self.votes > 0

    def close(self) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)


class BadSteps:
    """Consecutive and total non-finite steps; ``stop`` holds the message once K in a row."""

    def __init__(self, limit: int):
        self.limit, self.run, self.total = limit, 0, 0
        self.stop: str | None = None

    @staticmethod
    def is_bad(rec: dict[str, Any]) -> bool:
        return bool(rec.get("bad"))

    def update(self, rec: dict[str, Any], rank: int = -1) -> None:
        """Count ``rec``'s step; rank 0 (``rank``) says so when it was bad (``stop``: the message
        once the run must stop). ``rec["bad_steps"]``: the run's total so far."""
        if not self.is_bad(rec):
            self.run = 0
            rec["bad_steps"] = self.total
            return
        self.run += 1
        self.total += 1
        rec["bad_steps"] = self.total
        if rank == 0:
            print(f"step {rec['step']}: non-finite loss {rec['loss']} or gradient norm "
                  f"{rec['grad_norm']}: step skipped ({self.run} in a row, --max-bad-steps "
                  f"{self.limit})", flush=True)
        if self.run >= self.limit:
            self.stop = (f"stopped at step {rec['step']}: {self.run} steps in a row had a "
                         f"non-finite loss or gradient norm (--max-bad-steps {self.limit}); each "
                         "was skipped, nothing after the last good step was saved")


def non_finite(loss: float, grad_norm: float, fp16: bool) -> bool:
    """A bad step: NaN/inf loss, or NaN/inf gradient norm (in fp16 an infinite norm is the loss
    scaler's business: it skips the step and backs off, as it always has)."""
    return not math.isfinite(loss) or (not fp16 and not math.isfinite(grad_norm))


class History:
    """Bounded: the last ``WINDOW`` records, the first loss, totals; every loss as a double."""

    def __init__(self, window: int = WINDOW):
        self.records: deque[dict[str, Any]] = deque(maxlen=window)
        self.losses = array("d")
        self.first: dict[str, Any] | None = None
        self.steps = self.skipped = self.moe_dropped = 0
        self.evals: list[tuple[int, float]] = []

    def add(self, rec: dict[str, Any]) -> None:
        if self.first is None:
            self.first = {"step": rec["step"], "loss": rec["loss"]}
        self.records.append(rec)
        self.losses.append(rec["loss"])
        self.steps += 1
        self.skipped += bool(rec.get("skipped"))
        if rec.get("moe"):
            self.moe_dropped += rec["moe"]["dropped"]
        if "val_loss" in rec:
            self.evals.append((rec["step"], rec["val_loss"]))
