"""One engine replica of a Ray Serve deployment: its own engine and KV cache, streamed to the
ingress through a deployment handle, and its queue length and cache occupancy reported to the
router (Serve calls ``record_routing_stats`` on every replica periodically)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prefixrag.engine.async_engine import AsyncEngine
from prefixrag.engine.chunks.store import ChunkSpan
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling.params import SamplingParams


def replica_identity() -> tuple[str, str]:
    """This replica's Serve id and its rank-based name (``replica-0`` ...). The name is stable
    across a restart, unlike the id, so a restarted replica finds its own chunk disk tier."""
    from ray import serve

    context = serve.get_replica_context()
    return context.replica_id.unique_id, f"replica-{context.rank.rank}"


class EngineReplica:
    """The deployment's class: an AsyncEngine on ``config``, its stable prompt head pinned at
    start (so a replica that Ray restarts pins it again)."""

    # Serve awaits an async constructor: the pin runs on the replica's event loop
    async def __init__(self, config: EngineConfig, pinned_ids: list[int]) -> None:  # type: ignore[misc]
        self.replica_id, self.name = replica_identity()
        if config.chunk_disk_dir is not None:
            # replicas on one host must not share a disk tier: each writes its own files
            disk_dir = str(Path(config.chunk_disk_dir) / self.name)
            config = dataclasses.replace(config, chunk_disk_dir=disk_dir)
        self.engine = AsyncEngine.from_config(config)
        self.num_pinned = await self.engine.pin_prefix(pinned_ids) if pinned_ids else 0
        # generations started here and not yet finished: the queue length the router sees
        self.num_active = 0

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_scope: CacheScope,
        chunk_spans: tuple[ChunkSpan, ...] = (),
    ) -> AsyncIterator[GenerationDelta | GenerationResult]:
        """The engine's stream; Serve cancels it (and so aborts the request) when the caller
        stops reading."""
        self.num_active += 1
        stream = self.engine.generate(
            prompt_ids, params, cache_scope=cache_scope, chunk_spans=chunk_spans
        )
        try:
            async for item in stream:
                yield item
        finally:
            self.num_active -= 1
            await stream.aclose()  # type: ignore[attr-defined]

    def describe(self, *, target: str) -> dict[str, Any]:
        """Who this replica is and what it holds, for the ingress and /readyz."""
        self._check_target(target)
        return {
            "replica_id": self.replica_id,
            "name": self.name,
            "pid": os.getpid(),
            "max_model_len": self.engine.max_model_len,
            "num_kv_blocks": self.engine.num_kv_blocks,
            "num_pinned_tokens": self.num_pinned,
            "num_active": self.num_active,
        }

    def stats(self, *, target: str) -> dict[str, int]:
        """The engine's prefix-cache counters and block gauges (the /metrics series)."""
        self._check_target(target)
        return self.engine.stats()

    async def drop_chunks(self, namespace: str, tag: str, *, target: str) -> int:
        """Forget a deleted document's chunk bodies here."""
        self._check_target(target)
        return await self.engine.drop_chunks(namespace, tag)

    async def drop_chunk_tags(self, pairs: list[tuple[str, str]], *, target: str) -> int:
        """Forget the bodies of every (namespace, tag) in ``pairs``: deletes this replica missed
        while it was down (its disk tier outlives it)."""
        self._check_target(target)
        return sum([await self.engine.drop_chunks(namespace, tag) for namespace, tag in pairs])

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router weighs: requests here, and the share of KV blocks not free."""
        stats = self.engine.stats()
        total = max(1, stats["blocks_total"])
        return {
            "name": self.name,
            "num_queued": self.num_active,
            "cache_occupancy": 1.0 - stats["blocks_free"] / total,
        }

    def _check_target(self, target: str) -> None:
        # a broadcast reaches each replica by id: one that lands elsewhere is a routing bug
        if target != self.replica_id:
            raise RuntimeError(f"a call for replica {target} reached {self.replica_id}")

    def check_health(self) -> None:
        """Serve's health probe: a replica whose engine thread died is restarted."""
        if not self.engine.is_alive:
            raise RuntimeError(f"{self.name}: the engine thread has stopped")
