"""Checkpoints: save/resume with torch.distributed.checkpoint in global names and shapes
(``state``), atomic directories with a manifest (``storage``), the boxes a rank owns
(``pieces``), Hugging Face import/export (``hf``). See docs/checkpoints.md."""

from .state import SaveError, Saver, load, rank_state
from .storage import resolve, verify

__all__ = ["SaveError", "Saver", "load", "rank_state", "resolve", "verify"]
