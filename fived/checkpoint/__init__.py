"""Checkpoints: save/resume with torch.distributed.checkpoint in global names and shapes
(``state``), atomic directories with a manifest (``storage``), the boxes a rank owns
(``pieces``), Hugging Face import/export (``hf``). See docs/checkpoints.md.

The names below are loaded on first use: ``storage`` (what ``fived train --resume auto``
reads before it prints its first line) must not import torch through ``state``."""

from __future__ import annotations

from typing import Any

__all__ = ["SaveError", "Saver", "load", "rank_state", "resolve", "verify"]
_STATE = {"SaveError", "Saver", "load", "rank_state"}


def __getattr__(name: str) -> Any:
    if name in _STATE:
        from . import state

        return getattr(state, name)
    if name in ("resolve", "verify"):
        from . import storage

        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
