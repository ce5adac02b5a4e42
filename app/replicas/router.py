"""The engine deployment's Ray Serve request router: prefix affinity (the engine's own block
keys, tenant-salted) with a least-loaded fallback, from app/replicas/prefix_affinity.py.

Serve builds one router per deployment handle, in the process that holds the handle (here the
ingress), and asks it to rank the live replicas for each request. A request that names a
``target`` replica (a broadcast: describe, stats, drop_chunks) goes there and nowhere else.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixrag.app.replicas.prefix_affinity import AffinityConfig, PrefixAffinityPolicy, ReplicaLoad
from prefixrag.engine.kv_cache.cache_scope import CacheScope

# seconds a chosen replica counts a request that Serve has not reported sent
PENDING_TTL_S = 5.0


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
        # generate requests by Serve's request id: chosen and not yet sent (replica, keys,
        # when), and sent and not yet complete (replica)
        self._pending: dict[str, tuple[str, list[bytes], float]] = {}
        self._running: dict[str, str] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target")
        if target is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            # NOTE: a target Serve no longer lists (it died) is never coming back, and Serve
            # would hold the request, and every request queued behind it, until it did. Any
            # replica refuses a call meant for another at once (EngineReplica._check_target),
            # so the caller gets its error now.
            return [chosen or candidate_replicas]
        if not candidate_replicas:
            return []
        if self.routing == "round_robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            self._num_routed += 1
            return [[ordered[self._num_routed % len(ordered)]]]
        request_id = pending_request.metadata.internal_request_id if pending_request else ""
        self._pending.pop(request_id, None)  # a retry: choose afresh
        in_flight = self._num_in_flight()
        loads = {
            r.replica_id.unique_id: self._load_of(r, in_flight.get(r.replica_id.unique_id, 0))
            for r in candidate_replicas
        }
        keys: list[bytes] = []
        if "prompt_ids" in kwargs:
            scope = kwargs.get("cache_scope") or CacheScope()
            keys = self.policy.prefix_keys(kwargs["prompt_ids"], scope)
        decision = self.policy.choose(keys, loads)
        if request_id and "prompt_ids" in kwargs:
            self._pending[request_id] = (decision.replica, keys, time.monotonic())
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        rest = sorted(
            (r for r in candidate_replicas if r.replica_id.unique_id != decision.replica),
            key=lambda r: loads[r.replica_id.unique_id].num_queued,
        )
        return [[by_id[decision.replica]], *([r] for r in rest)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):  # type: ignore[no-untyped-def]
        """The request went to ``replica_id`` (maybe not our first pick): it caches the prefix
        there now."""
        request_id = pending_request.metadata.internal_request_id
        pending = self._pending.pop(request_id, None)
        if pending is None:  # not a generate request (a broadcast)
            return
        self.policy.record(replica_id.unique_id, pending[1])
        self._running[request_id] = replica_id.unique_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._running.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # a replica that left took its cache with it; its successor starts cold
        live = [r.replica_id.unique_id for r in replicas]
        self.policy.retain(live)
        self._running = {q: r for q, r in self._running.items() if r in live}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self._running = {q: r for q, r in self._running.items() if r != replica_id.unique_id}

    def _num_in_flight(self) -> Counter[str]:
        """Generate requests per replica that this router sent or is sending now.

        NOTE: a request counts from the moment it is chosen, not only once Serve reports it
        sent, or requests arriving together would all see the same idle replica. A choice that
        Serve never sends (the caller gave up) stops counting after PENDING_TTL_S.
        """
        now = time.monotonic()
        for request_id, (_, _, since) in list(self._pending.items()):
            if now - since > PENDING_TTL_S:
                del self._pending[request_id]
        counts = Counter(self._running.values())
        counts.update(replica for replica, _, _ in self._pending.values())
        return counts

    def _load_of(self, replica: RunningReplica, num_mine: int) -> ReplicaLoad:
        # NOTE: the replica's own report is up to a stats period old (a request that finished
        # still shows), so it only breaks ties; our in-flight count is exact for this ingress,
        # and one ingress per cluster sends all the generate requests.
        reported = replica.routing_stats or {}
        occupancy = float(reported.get("cache_occupancy", 0.0))
        return ReplicaLoad(
            num_queued=num_mine,
            cache_occupancy=min(1.0, max(0.0, occupancy)),
            num_reported=max(0, int(reported.get("num_queued", 0))),
        )
