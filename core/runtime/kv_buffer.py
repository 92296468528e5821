"""Keys and values of one attention layer in a buffer allocated once: written in place, compacted
in place, cropped without copying. The target's KV cache and the drafter's both use it."""

from __future__ import annotations

import torch


class KVBuffer:
    """Keys and values [B, H, capacity, D], the first ``length`` positions filled. A caller that
    under-sized ``capacity`` pays one doubling copy, never a per-token concatenation."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = max(int(capacity), 1)
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [B, H, T, D] after the filled entries; return views of all of them."""
        end = self.length + k.shape[-2]
        if self._k is None or end > self._k.shape[-2] or self._k.shape[:2] != k.shape[:2]:
            size = max(end, self.capacity if self._k is None else 2 * self._k.shape[-2])
            old_k, old_v = self._k, self._v
            self._k = k.new_empty(*k.shape[:2], size, k.shape[-1])
            self._v = v.new_empty(*v.shape[:2], size, v.shape[-1])
            if old_k is not None and self.length:
                self._k[:, :, :self.length] = old_k[:, :, :self.length]
                self._v[:, :, :self.length] = old_v[:, :, :self.length]
        self._k[:, :, self.length:end] = k
        self._v[:, :, self.length:end] = v
        self.length = end
        return self.views()

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled keys and values (views of the buffer, no copy)."""
        return self._k[:, :, :self.length], self._v[:, :, :self.length]

    @property
    def keys(self) -> torch.Tensor:
        return self.views()[0]

    @property
    def values(self) -> torch.Tensor:
        return self.views()[1]

    def keep(self, past: int, keep: torch.Tensor | None, count: int) -> None:
        """Keep the first ``past`` entries and the ``count`` entries ``past + keep`` after them, in
        that order; ``keep=None`` keeps the first ``count`` (nothing moves)."""
        if keep is not None and self._k is not None:
            moved = past + keep
            self._k[:, :, past:past + count] = self._k.index_select(2, moved)
            self._v[:, :, past:past + count] = self._v.index_select(2, moved)
        self.length = past + count

    def crop(self, length: int) -> None:
        """Drop every entry from position ``length`` on."""
        self.length = min(self.length, max(int(length), 0))
