"""Run hooks: what a caller observes or injects at fixed points of ``train_rank``, so that no
test-only branch lives in the loop. A hook is any object with some of

* ``on_step_start(trainer, step)`` — before the step reads its batch;
* ``on_grads(trainer, step)`` — once the step's gradients are reduced, before the clip.

``train_rank(..., hooks=[...])`` takes a run's own; ``install(hook)`` adds one to every run of
this process (a rank that torchrun starts cannot be handed objects: the recovery tests' script
``tests/die_at.py`` installs its fault injection, then runs fived's command line). fived itself
installs none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

INSTALLED: list[Any] = []


def install(hook: Any) -> Any:
    INSTALLED.append(hook)
    return hook


def uninstall(hook: Any) -> None:
    INSTALLED.remove(hook)


class Hooks:
    """The installed hooks and a run's own, called in that order."""

    def __init__(self, extra: list[Any] | tuple[Any, ...] = ()):
        self.all = [*INSTALLED, *extra]

    def step_start(self, trainer: Any, step: int) -> None:
        for h in self.all:
            if hasattr(h, "on_step_start"):
                h.on_step_start(trainer, step)

    def grads(self, trainer: Any, step: int) -> Callable[[], None] | None:
        """The callback ``Trainer.step`` runs once the gradients are reduced (None: none)."""
        calls = [h.on_grads for h in self.all if hasattr(h, "on_grads")]
        if not calls:
            return None

        def run() -> None:
            for f in calls:
                f(trainer, step)
        return run
