"""The key/value cache of generation: every layer's keys and values, preallocated once.

A batch of ``b`` rows is generated in ``slots`` positions (the longest prompt plus the new
tokens). Prompts are **left-padded** to one length, so every row's next token lands in the same
slot; ``valid`` marks the slots that hold real tokens. A forward of ``n`` new tokens (the whole
prompt at prefill, one token per step after it) writes its keys and values into slots
``[filled, filled + n)`` of each layer and attends over ``[0, filled + n)`` with

    allowed[r, q, j] = (j ≤ filled + q and valid[r, j])  or  j = filled + q

— causal, blind to padding; the second term lets a pad query see itself so its (unused) row
stays finite. Each row's RoPE positions count its real tokens only (the caller passes them), so
a padded row computes what it computes alone. Memory: 2 · layers · b · slots · kv_heads/tp ·
head_dim elements in the compute dtype, allocated at the first forward from the layer's own
key and value shapes (a tensor-parallel rank holds its heads only). Multi-head latent
attention (``fived.model.mla``) stores its latent (kv_lora_rank) as the "key" and its rotary
key (qk_rope_head_dim) as the "value" of one shared head: layers · b · slots · (kv_lora_rank
+ qk_rope_head_dim) elements, whole on every tp rank.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of ``batch`` rows in ``slots`` positions, on ``device``."""

    def __init__(self, batch: int, slots: int, device: torch.device | str = "cpu"):
        self.batch, self.slots = batch, slots
        self.filled = 0  # slots written by earlier forwards
        self.valid = torch.zeros(batch, slots, dtype=torch.bool, device=device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._allowed: torch.Tensor | None = None
        self._n = 0

    def begin(self, real: torch.Tensor) -> None:
        """The next forward's ``n`` tokens, ``real`` (b, n) bool: False for padding."""
        n = real.shape[1]
        if self.filled + n > self.slots:
            raise ValueError(f"the cache holds {self.slots} slots; {self.filled} are filled "
                             f"and {n} more were given")
        self.valid[:, self.filled:self.filled + n] = real
        end = self.filled + n
        j = torch.arange(end, device=real.device)
        q = torch.arange(self.filled, end, device=real.device)
        causal = j[None, :] <= q[:, None]  # (n, end)
        self_slot = j[None, :] == q[:, None]
        allowed = (causal[None] & self.valid[:, None, :end]) | self_slot[None]
        self._allowed, self._n = allowed[:, None], n  # (b, 1, n, end)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store layer ``layer``'s new keys/values (b, n, kv_heads, d); return all of them so
        far and the attention mask (``fived.model.layers.masked_attention``)."""
        if self._allowed is None or k.shape[1] != self._n:
            raise RuntimeError("KVCache.begin(real) must announce each forward's tokens")
        if layer not in self.keys:  # each its own width (MLA: the latent, the rotary key)
            self.keys[layer] = k.new_zeros((self.batch, self.slots) + tuple(k.shape[2:]))
            self.values[layer] = v.new_zeros((self.batch, self.slots) + tuple(v.shape[2:]))
        end = self.filled + self._n
        self.keys[layer][:, self.filled:end] = k
        self.values[layer][:, self.filled:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end], self._allowed

    def advance(self) -> None:
        """The forward is done: its slots are filled."""
        self.filled += self._n
        self._allowed, self._n = None, 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values)
                   for t in d.values())


class LayerCache:
    """One layer's view of a ``KVCache`` (what ``Attention.forward`` is handed)."""

    def __init__(self, cache: KVCache, layer: int):
        self.cache, self.layer = cache, layer

    def update(self, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.cache.update(self.layer, k, v)
