"""The chunk store's tiers beyond the KV pool: host RAM, and a disk directory that outlives the
process. One object, handed to the scheduler, moves entries between them and the pool.

- ``spill``: an entry the pool evicts is copied to host RAM while that tier has room;
- ``load``: a body the pool lacks comes back from host RAM, else from disk, into pool blocks;
- ``capture``: a prompt whose prefill just ended holds the KV of every body it names; the ones
  the store lacks are kept, at the position they had there (and written to disk, when on).

The KV itself moves through a :class:`ChunkKV` (the model runner): block ids in, tensors out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from prefixrag.engine.chunks.disk_tier import DiskTier
from prefixrag.engine.chunks.host_tier import HostTier, TierEntry
from prefixrag.engine.chunks.store import ChunkEntry, ChunkSpan, ChunkStore

if TYPE_CHECKING:
    from prefixrag.engine.scheduler import ScheduledSeq


class ChunkKV(Protocol):
    """Chunk KV in and out of pool blocks (ModelRunner)."""

    def read_chunk(
        self, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_chunk(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None: ...

    def copy_chunk(
        self, src_block_ids: Sequence[int], start: int, length: int, dst_block_ids: Sequence[int]
    ) -> None: ...


class ChunkTiers:
    """Host RAM of ``host_bytes`` (0: none) and, with ``disk_dir``, a disk tier of
    ``disk_bytes`` whose files are valid only for the model ``fingerprint`` names. ``attach``
    gives it the store it serves (the scheduler's), before the first step."""

    def __init__(
        self,
        kv: ChunkKV,
        *,
        host_bytes: int,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
        fingerprint: dict[str, str | int] | None = None,
    ) -> None:
        self._kv = kv
        self.host = HostTier(host_bytes)
        self.disk = (
            DiskTier(Path(disk_dir), fingerprint=fingerprint or {}, max_bytes=disk_bytes)
            if disk_dir
            else None
        )
        self._store: ChunkStore | None = None

    def attach(self, store: ChunkStore) -> None:
        self._store = store

    @property
    def store(self) -> ChunkStore:
        if self._store is None:
            raise RuntimeError("ChunkTiers.attach(store) must come before the first step")
        return self._store

    def spill(self, entry: ChunkEntry) -> None:
        """The pool evicts ``entry``: keep it in host memory while the tier has room."""
        if self.host.max_bytes == 0:
            return
        k, v = self._kv.read_chunk(entry.block_ids, entry.num_tokens)
        tier_entry = TierEntry(entry.namespace, entry.token_ids, entry.base_pos, entry.tags, k, v)
        self.host.put(entry.key, tier_entry)

    def load(self, namespace: str, body: tuple[int, ...], span: ChunkSpan) -> ChunkEntry | None:
        """A body the pool lacks, from host memory, else from disk, back into pool blocks; None
        when no tier has it or the pool has no room."""
        store = self.store
        key = store.key_for(namespace, body)
        found = self.host.take(key, namespace, body)
        if found is None and self.disk is not None:
            on_disk = self.disk.get(key, namespace, body)
            if on_disk is not None:
                base_pos, k, v, tags = on_disk
                found = TierEntry(namespace, body, base_pos, tags, k, v)
        if found is None:
            return None
        tags = tuple(dict.fromkeys((*found.tags, *span.tags)))
        entry = store.insert(namespace, body, base_pos=found.base_pos, tags=tags)
        if entry is None:
            return None
        self._kv.write_chunk(entry.block_ids, found.k, found.v)
        return entry

    def capture(self, items: Iterable[ScheduledSeq]) -> None:
        """Keep the bodies that prompts whose prefill ended in this step name and the store
        lacks, at the position they had there."""
        store = self.store
        if not store.enabled:
            return
        for item in items:
            seq = item.seq
            if (
                not seq.chunk_spans
                or not item.start_pos < seq.num_prompt_tokens <= item.context_len
            ):
                continue
            namespace = seq.cache_scope.namespace
            for span in seq.chunk_spans:
                body = seq.token_ids[span.start : span.end]
                if store.lookup(namespace, body, count=False) is not None:
                    continue
                entry = store.insert(namespace, body, base_pos=span.start, tags=span.tags)
                if entry is None:
                    return  # the pool is full of live sequences: no reuse, never an error
                self._kv.copy_chunk(item.block_ids, span.start, span.length, entry.block_ids)
                if self.disk is not None:
                    k, v = self._kv.read_chunk(entry.block_ids, entry.num_tokens)
                    # read_chunk made fresh copies: the tier may keep them as they are
                    self.disk.put(
                        entry.key,
                        namespace,
                        entry.token_ids,
                        entry.base_pos,
                        entry.tags,
                        k,
                        v,
                        copy=False,
                    )

    def drop_tag(self, namespace: str, tag: str) -> int:
        """Forget the entries of ``namespace`` tagged ``tag`` in the host and disk tiers."""
        dropped = self.host.drop_tag(namespace, tag)
        if self.disk is not None:
            dropped += self.disk.drop_tag(namespace, tag)
        return dropped

    def close(self) -> None:
        """Finish pending disk writes."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> dict[str, int]:
        disk = self.disk.stats() if self.disk is not None else {}
        return {
            "chunk_host_entries": self.host.num_entries,
            "chunk_host_bytes": self.host.bytes,
            "chunk_host_hits": self.host.hits,
            "chunk_host_evictions": self.host.evictions,
            "chunk_disk_files": int(disk.get("num_files", 0)),
            "chunk_disk_bytes": int(disk.get("bytes", 0)),
            "chunk_disk_hits": int(disk.get("hits", 0)),
            "chunk_disk_corrupt": int(disk.get("corrupt", 0)),
        }
