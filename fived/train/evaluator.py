"""``--eval-every N``: when a run evaluates and what that adds to the step's record.

After step 0, every N steps and after the last step, ``Trainer.evaluate`` (forward only, the
validation split; docs/eval.md) adds ``val_loss`` and ``val_ppl`` to the step's record, after
the step's own statistics were taken (its traffic is apart); rank 0 prints the line above the
live display."""

from __future__ import annotations

from typing import Any


class Evaluator:
    def __init__(self, trainer: Any, train: Any):
        self.trainer, self.every, self.steps = trainer, train.eval_every, train.steps

    def due(self, step: int) -> bool:
        return bool(self.every) and (step == 0 or (step + 1) % self.every == 0
                                     or step == self.steps - 1)

    def after_step(self, rec: dict[str, Any], step: int, metrics: Any) -> None:
        if not self.due(step):
            return
        rec.update(self.trainer.evaluate())
        by = "".join(f", {k} {v:.4f}" for k, v in (rec.get("val_loss_by_source") or {}).items())
        metrics.note(f"step {step}: validation loss {rec['val_loss']:.4f}, perplexity "
                     f"{rec['val_ppl']:.2f}{by}")
