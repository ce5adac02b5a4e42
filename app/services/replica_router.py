"""The engine deployment's Ray Serve request router: prefix affinity (the engine's own block
keys, tenant-salted) with a least-loaded fallback, from engine/prefix_affinity.py.

Serve builds one router per deployment handle, in the process that holds the handle (here the
ingress), and asks it to rank the live replicas for each request. A request that names a
``target`` replica (a broadcast: describe, stats, drop_chunks) goes there and nowhere else.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixrag.engine.cache_scope import CacheScope
from prefixrag.engine.prefix_affinity import AffinityConfig, PrefixAffinityPolicy, ReplicaLoad


class PrefixAffinityRouter(RequestRouter):
    """Ranks the replica holding a generate request's prefix first, the rest by load after it
    (Serve falls back to them when the first is full)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``kwargs``: the fields of :class:`AffinityConfig` (the deployment's
        request_router_kwargs), and ``routing``: "prefix", or "round_robin" to ignore prefixes
        (the baseline that shows what affinity is worth)."""
        self.routing = kwargs.pop("routing", "prefix")
        if self.routing not in ("prefix", "round_robin"):
            raise ValueError(f"routing must be 'prefix' or 'round_robin', got {self.routing!r}")
        self.policy: PrefixAffinityPolicy[str] = PrefixAffinityPolicy(AffinityConfig(**kwargs))
        self._num_routed = 0
        # requests this router sent and Serve has not reported complete, per replica
        self.num_in_flight: dict[str, int] = {}
        self._keys_by_request: dict[str, list[bytes]] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target")
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        if not candidate_replicas:
            return []
        if self.routing == "round_robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            self._num_routed += 1
            return [[ordered[self._num_routed % len(ordered)]]]
        loads = {r.replica_id.unique_id: self._load_of(r) for r in candidate_replicas}
        keys: list[bytes] = []
        if "prompt_ids" in kwargs:
            scope = kwargs.get("cache_scope") or CacheScope()
            keys = self.policy.prefix_keys(kwargs["prompt_ids"], scope)
        decision = self.policy.choose(keys, loads)
        if pending_request is not None:
            self._keys_by_request[pending_request.metadata.internal_request_id] = keys
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        rest = sorted(
            (r for r in candidate_replicas if r.replica_id.unique_id != decision.replica),
            key=lambda r: loads[r.replica_id.unique_id].num_queued,
        )
        return [[by_id[decision.replica]], *([r] for r in rest)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):  # type: ignore[no-untyped-def]
        """The request went to ``replica_id`` (maybe not our first pick): it caches the prefix
        there now."""
        key = replica_id.unique_id
        keys = self._keys_by_request.pop(pending_request.metadata.internal_request_id, [])
        if keys:
            self.policy.record(key, keys)
        self.num_in_flight[key] = self.num_in_flight.get(key, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = replica_id.unique_id
        self.num_in_flight[key] = max(0, self.num_in_flight.get(key, 0) - 1)
        self._keys_by_request.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # a replica that left took its cache with it; its successor starts cold
        live = [r.replica_id.unique_id for r in replicas]
        self.policy.retain(live)
        self.num_in_flight = {r: n for r, n in self.num_in_flight.items() if r in live}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self.num_in_flight.pop(replica_id.unique_id, None)

    def _load_of(self, replica: RunningReplica) -> ReplicaLoad:
        # NOTE: the replica's own report counts every ingress's requests but is up to a stats
        # period old; our in-flight count is current but only ours. Take the larger.
        reported = replica.routing_stats or {}
        mine = self.num_in_flight.get(replica.replica_id.unique_id, 0)
        occupancy = float(reported.get("cache_occupancy", 0.0))
        return ReplicaLoad(
            num_queued=max(mine, int(reported.get("num_queued", 0))),
            cache_occupancy=min(1.0, max(0.0, occupancy)),
        )
