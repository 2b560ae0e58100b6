"""Padded vocabulary rows must not change the loss: their logits are masked before it.

A model whose ``vocab`` exceeds the tokenizer's ``n`` symbols (``fived.data.meta.padded_vocab``)
has output rows no target ever names; left alone their logits would still enter every
softmax's denominator. ``mask_padded_logits(model, n)`` wraps each ``loss`` module of the laid
out model so that logits of global ids ``>= n`` become the dtype's most negative value before
the loss: their softmax weight is 0, the loss and every gradient equal those of an ``n``-row
head, and those rows' gradient is exactly zero. Under tensor parallelism the loss sees a vocab
slice (the vocab-parallel loss has the tp ``group``); the slice of rank ``r`` starts at
``r · V/tp``. A finite minimum (not -inf) keeps the vocab-parallel loss's
``gathered logit × inside-mask`` products finite.

The targets carry two marks past the vocabulary to the loss, through every path they take:
a mixture's row source (``target + (source << 32)``, ``SourceLoss``, the outermost wrapper)
and ``--eos-target ignore``'s skip bit (``IGNORE_BIT`` = 2³¹, ``IgnoredTargetLoss``, inside
it): the loss is Σ CE over the kept tokens, normalised as always by 1/(global batch · seq_len).
"""

from __future__ import annotations

import torch
from torch import nn


class MaskedLoss(nn.Module):
    def __init__(self, inner: nn.Module, used: int, vocab: int):
        super().__init__()
        self.inner, self.used, self.vocab = inner, used, vocab

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        v = logits.shape[-1]
        group = getattr(self.inner, "group", None)
        start = group.rank * v if (v < self.vocab and group is not None) else 0
        ids = torch.arange(start, start + v, device=logits.device)
        pad = ids >= self.used
        if bool(pad.any()):
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        return self.inner(logits, targets)


def mask_padded_logits(model: nn.Module, used: int, vocab: int) -> int:
    """Wrap every ``loss`` module of ``model`` and of its pipeline chunks (shared ones once);
    returns how many."""
    if used >= vocab:
        return 0
    wrapped: dict[int, MaskedLoss] = {}
    # a pipeline StageModel keeps its chunks (which own the loss) in a plain list
    roots = [model, *getattr(model, "chunk_models", [])]
    for m in [m for r in roots for m in r.modules()]:
        inner = m._modules.get("loss")
        if inner is None or isinstance(inner, MaskedLoss) or isinstance(m, MaskedLoss):
            continue
        if id(inner) not in wrapped:
            wrapped[id(inner)] = MaskedLoss(inner, used, vocab)
        m.loss = wrapped[id(inner)]
    return len(wrapped)


SOURCE_SHIFT = 32  # a mixture's targets carry their row's source: target + (source << 32)


def split_source(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's source, the target without it) of a mixture's marked targets."""
    src = targets >> SOURCE_SHIFT
    return src, targets - (src << SOURCE_SHIFT)


class SourceLoss(nn.Module):
    """A mixture's per-source loss (``--data NAME=DIR:W,...``): the loader adds each row's
    source index, shifted by ``SOURCE_SHIFT`` bits, to its targets (vocabularies are far below
    2³²), so the source reaches the loss through every path the targets take (micro-batches,
    cp shards, the pipeline's last stage, evaluation) with no new argument. This outermost loss
    module splits the rows by source, runs the inner loss on each group (the sum is the same
    loss) and adds each group's detached sum to ``tally[source]``."""

    def __init__(self, inner: nn.Module, sources: int):
        super().__init__()
        self.inner, self.sources = inner, sources
        self.tally: list[torch.Tensor | None] = [None] * sources

    def reset(self) -> None:
        self.tally = [None] * self.sources

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        src, real = split_source(targets)
        row_src = src.reshape(src.shape[0], -1)[:, 0]
        total = None
        for k in torch.unique(row_src).tolist():
            rows = (row_src == k).nonzero().flatten()
            part = (self.inner(logits, real) if len(rows) == src.shape[0]
                    else self.inner(logits[rows], real[rows]))
            prev = self.tally[k]
            self.tally[k] = part.detach().float() if prev is None else prev + part.detach().float()
            total = part if total is None else total + part
        assert total is not None
        return total

    def untallied(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The same loss with nothing tallied (multi-token prediction's modules: the
        per-source losses are the trunk's)."""
        return self.inner(logits, split_source(targets)[1])


def tally_sources(model: nn.Module, sources: int) -> list[SourceLoss]:
    """Wrap every outermost ``loss`` module of ``model`` (and of its pipeline chunks, shared
    ones once) in a ``SourceLoss``; returns the wrappers (none on a stage without the head)."""
    wrapped: dict[int, SourceLoss] = {}
    roots = [model, *getattr(model, "chunk_models", [])]
    for m in [m for r in roots for m in r.modules()]:
        inner = m._modules.get("loss")
        if inner is None or isinstance(inner, SourceLoss) or isinstance(m, (SourceLoss,
                                                                             MaskedLoss)):
            continue
        if id(inner) not in wrapped:
            wrapped[id(inner)] = SourceLoss(inner, sources)
        m.loss = wrapped[id(inner)]
    return list(wrapped.values())


IGNORE_BIT = 1 << 31  # --eos-target ignore: a target the loss skips carries this bit


def mark_eos_targets(x: torch.Tensor, y: torch.Tensor, eos: int) -> torch.Tensor:
    """``--eos-target ignore``: the targets whose input token is EOS (the next document's first
    token) marked by ``IGNORE_BIT``; the mark travels with the targets (micro-batches, cp
    shards, the last pipeline stage) like a mixture's source bits."""
    return torch.where(x == eos, y | IGNORE_BIT, y)


class IgnoredTargetLoss(nn.Module):
    """Σ CE over the tokens whose target is not marked by ``mark_eos_targets``: the kept tokens'
    logits and targets (one row) go to the inner loss, so a skipped token adds nothing to the
    loss and no gradient. Every tp rank holds the same targets, so the vocab-parallel loss's
    collectives see one shape on every rank."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        marked = (targets & IGNORE_BIT) != 0
        if not bool(marked.any()):
            return self.inner(logits, targets)
        keep = ~marked
        return self.inner(logits[keep][None], targets[keep][None])


def ignore_marked_targets(model: nn.Module) -> int:
    """Wrap every ``loss`` module of ``model`` and of its pipeline chunks (shared ones once) in
    an ``IgnoredTargetLoss``; returns how many."""
    wrapped: dict[int, IgnoredTargetLoss] = {}
    roots = [model, *getattr(model, "chunk_models", [])]
    for m in [m for r in roots for m in r.modules()]:
        inner = m._modules.get("loss")
        if inner is None or isinstance(m, (IgnoredTargetLoss, MaskedLoss, SourceLoss)):
            continue
        if id(inner) not in wrapped:
            wrapped[id(inner)] = IgnoredTargetLoss(inner)
        m.loss = wrapped[id(inner)]
    return len(wrapped)
