"""The memory trace: every tensor storage of the process from its creation to its death, summed
into the live bytes of a step, phase by phase — the quantity the ledger's peak predicts.

``with LiveTensors() as trace:`` (a ``TorchDispatchMode``) sees every aten op that runs while it
is active, on any thread autograd uses. Each output tensor's storage is counted once
(``untyped_storage().nbytes()``; views share it) from the op that creates it until the storage
itself is freed — a ``weakref`` to the storage object, whose callback runs when its last owner
lets go (a view, autograd's saved tensors, a bucket, the optimizer's state). A storage resized in
place counts its new size: through ``UntypedStorage.resize_`` (ZeRO-3's gather and free, the
pipeline's release of a sent activation — patched while the trace is active) or an aten op that
resizes its argument (every tensor argument is looked at again after each op).

Phases come from ``fived.phases``: the trace records, for each phase, the live bytes on entry,
the largest live bytes inside it and the live bytes when it ended (``PhaseRecord``);
``step_peak`` is the largest after the build, with the phase that holds it.

It runs on real tensors (``fived train --memory-trace``; every op pays the Python dispatch, the
cost is measured in docs/ledger.md) and on fake ones (the dry run: fake storages have sizes and
lifetimes like real ones). What it does not see: memory that is not a tensor storage (the
allocator's cache, the interpreter, gloo's own buffers) — the process's RSS says those — nor
what the data source holds while it makes a batch (``untracked``: the built-in corpus, the
loader's buffers); the batch itself is counted from its first use by the step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import phases


@dataclass
class PhaseRecord:
    name: str
    start: int  # live bytes when the phase began
    peak: int = 0  # the most live at once inside it
    end: int = 0  # live bytes when the next phase began

    def as_list(self) -> list:
        return [self.name, self.start, self.peak, self.end]


class LiveTensors(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.series = [PhaseRecord("build", 0)]
        self._size: dict[int, int] = {}
        self._refs: dict[int, Any] = {}
        self._resize: Any = None
        self.paused = False

    # ------------------------------------------------------------------ counting
    def _set(self, key: int, n: int) -> None:
        self.live += n - self._size.get(key, 0)
        self._size[key] = n
        if self.live > self.series[-1].peak:
            self.series[-1].peak = self.live

    def _freed(self, key: int, _ref: Any) -> None:
        n = self._size.pop(key, None)
        if n is not None:
            self.live -= n
            del self._refs[key]

    def see(self, t: torch.Tensor) -> None:
        if t.is_meta and not isinstance(t, FakeTensor):  # a shape only (the born-sharded
            return  # model before its pieces are made): no memory; the dry run's are fake
        st = t.untyped_storage()
        key = st._cdata
        n = st.nbytes()
        if key not in self._size:
            self._refs[key] = weakref.ref(st, partial(self._freed, key))
        elif self._size[key] == n:
            return
        self._set(key, n)

    def seed(self, tensors: list[torch.Tensor]) -> None:
        """Count tensors made before the trace began (the built model and engine), once each
        storage, as the phase ``build``'s live bytes."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.see(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        for t in tree_flatten((out, args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.see(t)
        return out

    # ------------------------------------------------------------------ phases
    def enter(self, name: str) -> None:
        last = self.series[-1]
        last.end = self.live
        self.series.append(PhaseRecord(name, self.live, self.live))

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Ops here are not looked at (the data source: the built-in corpus or the loader's
        host-side buffers are not the model's memory); what they return is counted once the
        step's ops use it."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def restart(self) -> None:
        """A new step: the series and the peak start again from what is live now."""
        self.series = [PhaseRecord("start", self.live, self.live)]

    def step_peak(self) -> tuple[int, str]:
        """The largest live bytes after the build, and the phase that holds it."""
        best = max(self.series[1:] or self.series, key=lambda p: p.peak)
        return best.peak, best.name

    def by_phase(self) -> list[list]:
        self.series[-1].end = self.live
        return [p.as_list() for p in self.series]

    # ------------------------------------------------------------------ context
    def __enter__(self) -> LiveTensors:
        trace = self
        orig = torch.UntypedStorage.resize_

        def resize_(st: Any, n: int) -> Any:
            out = orig(st, n)
            if st._cdata in trace._size:
                trace._set(st._cdata, st.nbytes())
            return out

        self._resize = orig
        torch.UntypedStorage.resize_ = resize_
        phases.LISTENERS.append(self.enter)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        phases.LISTENERS.remove(self.enter)
        torch.UntypedStorage.resize_ = self._resize
