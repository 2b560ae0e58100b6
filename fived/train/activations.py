"""Measured activation memory: the bytes autograd saves for backward, via saved-tensor hooks.

``with SavedTensors() as s: loss = model(...)`` records every tensor autograd packs for the
backward pass. What is counted is storage, not shape: ``untyped_storage().nbytes()`` of each
distinct storage, once (views of one storage share it; a tensor over-allocated behind a smaller
view counts its whole allocation). Storages are told apart by identity, not by ``data_ptr`` (on
the meta device, and for empty tensors, every data pointer is 0), and each is held until the
``with`` block ends so that no address is reused inside it. Parameters, and the storages of
``exclude``, are not activations. ``s.bytes`` is the measured activation footprint of that
forward, the quantity the ledger's activation term predicts; ``s.by_dtype`` splits it,
``s.count`` is the number of storages and ``s.sizes`` lists each as (dtype, bytes).
"""

from __future__ import annotations

from collections import defaultdict

import torch


class SavedTensors:
    def __init__(self, exclude: list[torch.Tensor] | None = None):
        self._exclude = {t.untyped_storage()._cdata for t in (exclude or [])}
        self._held: dict[int, torch.UntypedStorage] = {}
        self.bytes = 0
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.count = 0
        self.sizes: list[tuple[str, int]] = []
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter):
            return t
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._held and key not in self._exclude:
            self._held[key] = storage
            n = storage.nbytes()
            self.bytes += n
            self.by_dtype[str(t.dtype)] += n
            self.count += 1
            self.sizes.append((str(t.dtype), n))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensors:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self._held.clear()
