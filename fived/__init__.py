"""fived: five-dimensional parallel training of transformer language models, with a ledger."""

__version__ = "0.1.0"
