"""The checkpoint manager of a run: resume, periodic saves, the preemption save, the wait.

* ``resume()`` — ``--resume DIR|auto`` (any layout's checkpoint into this one): the step to
  start from (0 without one);
* ``after_step(step, end, mems, bad_run, preempt)`` — after every step: a periodic save when
  due (``--save-every``, and the last step), never in a streak of bad steps (the newest
  checkpoint stays a good one, and ``--keep`` never prunes a good one for a bad one); then the
  preemption agreement that came with the step's loss (the same on every rank): a signal on any
  rank saves now, if not just saved, and ends the run (exit status 75, resumable with
  ``--resume auto``);
* ``wait()`` — the last asynchronous save finished (``--async-save``).

A save that fails on any rank raises ``fived.checkpoint.state.SaveError`` on every rank; the
previous checkpoint is intact.
"""

from __future__ import annotations

from typing import Any


class CheckpointManager:
    def __init__(self, trainer: Any, train: Any, show: bool):
        self.trainer, self.train, self.show = trainer, train, show
        self.saver = None
        self.preempted: int | None = None

    def resume(self) -> int:
        """Load ``--resume`` (if any) and open the saver (if ``--save-dir``): the first step."""
        start, train = 0, self.train
        if train.resume:
            from ..checkpoint import load, resolve

            start = load(self.trainer, resolve(train.resume))
        if train.save_dir:
            from ..checkpoint import Saver

            self.saver = Saver(self.trainer, train.save_dir, train.save_every, train.keep,
                               train.async_save, verbose=self.show)
        return start

    def after_step(self, step: int, end: int, mems: list[dict[str, int]], bad_run: int,
                   preempt: Any) -> bool:
        """Save if due; True when a preemption ends the run after this step."""
        saver, done = self.saver, step + 1
        saved = bool(saver and saver.due(done, end) and not bad_run)
        if saved:
            saver.save(done, mems)
        if not (preempt.agreed() and done < end):  # every rank, after the same step
            return False
        if saver and not saved and not bad_run:
            saver.save(done, mems)
            saved = True
        self.preempted = done
        if self.trainer.rank == 0:
            print(f"fived train: SIG{preempt.hit or 'TERM'} (on some rank): "
                  + (f"saved step {done} to {self.train.save_dir}; exiting with status 75 "
                     "(preempted, resumable with --resume auto)" if saved else
                     "nothing saved (no --save-dir, or a bad step); exiting with status 75"),
                  flush=True)
        return True

    def wait(self) -> None:
        if self.saver:
            self.saver.wait()
