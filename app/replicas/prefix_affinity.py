"""Which engine replica should serve a prompt: the one that has cached its prefix, unless that
one's queue is too long.

The router keeps, per replica, a bounded LRU memory of the block keys of prompts it sent there:
an approximation of that replica's radix tree (it cannot see evictions). The keys are the tree's
own (:func:`chained_block_keys`: tenant salt past the public head, chained from the root), so the
router's "same prefix" is the engine's, and a tenant's prompt can only follow its own history (or
the public head that every tenant shares) to a replica. Pure Python: no Ray, no torch.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.kv_cache.radix_cache import chained_block_keys

ReplicaKey = TypeVar("ReplicaKey", bound=Hashable)


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """A replica's load: requests the router has sent it that are waiting or running (exact),
    requests the replica itself last reported (possibly stale, but it sees every sender), and
    the share of its KV blocks in use or cached (0..1)."""

    num_queued: int = 0
    cache_occupancy: float = 0.0
    num_reported: int = 0

    def __post_init__(self) -> None:
        if self.num_queued < 0 or self.num_reported < 0:
            raise ValueError(
                f"queue lengths must be >= 0, got {self.num_queued} and {self.num_reported}"
            )
        if not 0.0 <= self.cache_occupancy <= 1.0:
            raise ValueError(f"cache_occupancy must be in [0, 1], got {self.cache_occupancy}")


@dataclass(slots=True, frozen=True)
class AffinityConfig:
    """``imbalance_threshold``: how many more queued requests than the least-loaded replica the
    prefix's replica may have before the prompt goes to the least-loaded one instead.
    ``max_prefix_blocks``: leading blocks hashed per prompt. ``max_keys_per_replica``: the
    bound on each replica's remembered block keys (LRU)."""

    block_size: int = 16
    imbalance_threshold: int = 4
    max_prefix_blocks: int = 256
    max_keys_per_replica: int = 65536

    def __post_init__(self) -> None:
        for name in ("block_size", "max_prefix_blocks", "max_keys_per_replica"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold}")


@dataclass(slots=True, frozen=True)
class RoutingDecision(Generic[ReplicaKey]):
    """The replica chosen, how many leading blocks its memory matched, and why it won."""

    replica: ReplicaKey
    num_matched_blocks: int
    reason: str  # "affinity", "least_loaded" (no match) or "imbalance" (match too busy)


class PrefixAffinityPolicy(Generic[ReplicaKey]):
    """Routes prompts by prefix affinity with a least-loaded fallback; remembers what it routed.

    Call :meth:`choose` with the live replicas' loads, then :meth:`record` with the replica the
    prompt actually went to (a transport may fall back to another), and :meth:`forget` when a
    replica dies (its successor starts with an empty cache).
    """

    def __init__(self, config: AffinityConfig | None = None) -> None:
        self.config = config or AffinityConfig()
        self._memory: dict[ReplicaKey, OrderedDict[bytes, None]] = {}
        self._num_choices = 0

    def prefix_keys(self, token_ids: Sequence[int], cache_scope: CacheScope) -> list[bytes]:
        """The engine's block keys of the prompt's leading full blocks past its public head.

        NOTE: the public head (the stable system prompt) is pinned on every replica, so matching
        it says nothing about where to go; counting it would draw every new conversation to the
        replicas that served before and starve a fresh one.
        """
        cfg = self.config
        num_public = cache_scope.num_public_blocks(cfg.block_size)
        keys = chained_block_keys(
            token_ids,
            cache_scope,
            cfg.block_size,
            max_num_blocks=num_public + cfg.max_prefix_blocks,
        )
        return keys[num_public:]

    def num_matched_blocks(self, replica: ReplicaKey, keys: Sequence[bytes]) -> int:
        """How many leading keys the replica's memory holds (keys chain, so stop at the first
        miss)."""
        memory = self._memory.get(replica)
        if not memory:
            return 0
        for i, key in enumerate(keys):
            if key not in memory:
                return i
        return len(keys)

    def choose(
        self, keys: Sequence[bytes], loads: Mapping[ReplicaKey, ReplicaLoad]
    ) -> RoutingDecision[ReplicaKey]:
        """The replica for a prompt with these block keys, among ``loads``' replicas.

        The longest remembered match wins, the less loaded among equal matches; with no match,
        the least loaded (by the router's own count, then the replica's report), then the one
        remembering least (so new conversations spread).
        NOTE: when the winner has more than ``imbalance_threshold`` requests queued beyond the
        least-loaded replica, the least-loaded one serves instead (and learns the prefix), so a
        hot prefix spreads over replicas rather than queueing on one while others idle.
        """
        if not loads:
            raise ValueError("no replica to route to")
        self._num_choices += 1
        spread = keys[-1] if keys else self._num_choices.to_bytes(8, "little")
        order = {
            replica: (
                load.num_queued,
                load.num_reported,
                self.num_remembered(replica),
                load.cache_occupancy,
                _rendezvous(replica, spread),
            )
            for replica, load in loads.items()
        }
        least = min(loads, key=order.__getitem__)
        matched = {replica: self.num_matched_blocks(replica, keys) for replica in loads}
        best = min(loads, key=lambda r: (-matched[r], order[r]))
        if matched[best] == 0:
            return RoutingDecision(least, 0, "least_loaded")
        excess = loads[best].num_queued - loads[least].num_queued
        if excess > self.config.imbalance_threshold:
            return RoutingDecision(least, matched[least], "imbalance")
        return RoutingDecision(best, matched[best], "affinity")

    def record(self, replica: ReplicaKey, keys: Iterable[bytes]) -> None:
        """Remember that ``replica`` now caches these blocks (most recent last; oldest dropped
        past the bound)."""
        memory = self._memory.setdefault(replica, OrderedDict())
        for key in keys:
            memory[key] = None
            memory.move_to_end(key)
        while len(memory) > self.config.max_keys_per_replica:
            memory.popitem(last=False)

    def forget(self, replica: ReplicaKey) -> None:
        """Drop a replica's memory (it died, or left)."""
        self._memory.pop(replica, None)

    def retain(self, replicas: Iterable[ReplicaKey]) -> None:
        """Forget every replica not in ``replicas`` (the live set changed)."""
        live = set(replicas)
        for gone in [r for r in self._memory if r not in live]:
            del self._memory[gone]

    def num_remembered(self, replica: ReplicaKey) -> int:
        """Block keys remembered for a replica."""
        return len(self._memory.get(replica, ()))


def _rendezvous(replica: Hashable, key: bytes) -> bytes:
    # a stable, per-key order of replicas: ties between equals go the same way for one prompt
    return hashlib.blake2b(repr(replica).encode() + key, digest_size=8).digest()
