"""The Llama-style decoder (and its MoE layer): a plain ``nn.Module``, the reference every layout
must equal. It imports nothing from ``fived.parallel``, ``fived.comm`` or ``fived.train``."""

from .llama import Transformer, build_model

__all__ = ["Transformer", "build_model"]
