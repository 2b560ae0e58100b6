"""Figures: matplotlib pictures of what fived runs (``fived figures NAME``)."""
