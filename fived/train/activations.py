"""Measured activation memory: the bytes autograd saves for backward, via saved-tensor hooks.

``with SavedTensors() as s: loss = model(...)`` records every tensor autograd packs for the
backward pass. Storage is counted once (views of one storage share it) and parameters are not
activations, so they are excluded. ``s.bytes`` is the measured activation footprint of that
forward, the quantity the ledger's activation term predicts; ``s.by_dtype`` splits it.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class SavedTensors:
    def __init__(self, exclude: list[torch.Tensor] | None = None):
        self._exclude = {t.untyped_storage().data_ptr() for t in (exclude or [])}
        self._seen: set[int] = set()
        self.bytes = 0
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.count = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen and key not in self._exclude:
            self._seen.add(key)
            n = storage.nbytes()
            self.bytes += n
            self.by_dtype[str(t.dtype)] += n
            self.count += 1
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensors:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
