"""The host-RAM tier of the chunk store: evicted entries' K/V as plain tensors, LRU by bytes.

An entry leaves the paged pool under pressure and lands here; a later hit copies it back into
pool blocks (and out of this tier). Lookups check namespace and tokens, never the key alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TierEntry:
    """A chunk body's K/V ([layers, tokens, Hkv, D] each) outside the pool."""

    namespace: str
    token_ids: tuple[int, ...]
    base_pos: int
    tags: tuple[str, ...]
    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class HostTier:
    """At most ``max_bytes`` of entries in host memory; the least recently used go first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def put(self, key: bytes, entry: TierEntry) -> bool:
        """Keep ``entry`` (its tensors are now this tier's); False if it can never fit."""
        if entry.num_bytes > self.max_bytes:
            return False
        self.discard(key)
        self._entries[key] = entry
        self.bytes += entry.num_bytes
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.num_bytes
            self.evictions += 1
        return True

    def take(self, key: bytes, namespace: str, token_ids: Sequence[int]) -> TierEntry | None:
        """Remove and return the entry for exactly these tokens of ``namespace``, if held."""
        entry = self._entries.get(key)
        if entry is None or entry.namespace != namespace or entry.token_ids != tuple(token_ids):
            self.misses += 1
            return None
        self.hits += 1
        self.discard(key)
        return entry

    def discard(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.num_bytes

    def drop_tag(self, namespace: str, tag: str) -> int:
        """Drop every entry of ``namespace`` tagged ``tag``; returns how many."""
        keys = [k for k, e in self._entries.items() if e.namespace == namespace and tag in e.tags]
        for key in keys:
            self.discard(key)
        return len(keys)
