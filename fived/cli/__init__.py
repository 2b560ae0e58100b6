"""fived's command line: one file per command, one flag set shared by all."""

from .main import main

__all__ = ["main"]
