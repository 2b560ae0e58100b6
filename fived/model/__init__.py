"""The Llama-style decoder. The one-rank build is the reference every layout must equal."""

from .llama import Transformer, build_model

__all__ = ["Transformer", "build_model"]
