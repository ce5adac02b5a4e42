"""Engine replicas on Ray Serve, behind an AsyncEngine-shaped client, so LLMService (and every
route above it) runs the same on one embedded engine or on N replicas.

The ingress keeps the tokenizer; each replica owns an engine and its KV cache. ``generate``
streams through a deployment handle whose request router (replica_router.py) sends a prompt to
the replica that has cached its prefix. Calls that every replica must see (stats, dropping a
deleted document's chunks) go to each live replica by id.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator

from prefixrag.app.core.errors import ReplicaUnavailableError
from prefixrag.app.core.settings import Settings
from prefixrag.app.replicas.engine_replica import EngineReplica
from prefixrag.app.replicas.prefix_affinity import AffinityConfig, PrefixAffinityPolicy
from prefixrag.app.replicas.router import PrefixAffinityRouter
from prefixrag.engine.chunks.store import ChunkSpan
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

APP_NAME = "prefixrag"
DEPLOYMENT_NAME = "engine"
# the seconds a client should wait before retrying a request whose replica died: Serve notices
# a dead replica within a health-check period and stops routing to it
REPLICA_RETRY_AFTER_S = 2
# deleted documents' chunk tags kept to replay to a replica that missed them (it was down, or
# restarted and reloaded its disk tier): a bound on the ingress's memory, not on correctness
# for any realistic delete rate between two restarts
DROP_LOG_LEN = 100_000
# a call sent to one replica by id waits while Serve has no such replica (it died): how long a
# delete waits on each replica's chunk drop before leaving it to the replay
DROP_TIMEOUT_S = 10.0
# Ray's errors when the replica serving a call dies or cannot be reached
REPLICA_ERRORS = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnavailableError,
    serve.exceptions.ReplicaUnavailableError,
    serve.exceptions.DeploymentUnavailableError,
)


class RayConnection:
    """This process's membership of a Ray cluster: joins ``address``, or starts a local cluster
    when it is empty, and leaves on ``close``.

    NOTE: a local cluster's processes (GCS, raylet) die with the *thread* that started them
    (Linux's parent-death signal is per thread), so ray.init runs on a thread of ours that
    lives until ``close``, not on the loader thread that returns once the app has loaded.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._started = threading.Event()
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hold, name="prefixrag-ray", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _hold(self) -> None:
        try:
            if not ray.is_initialized():
                ray.init(
                    address=self.address or None,
                    namespace=APP_NAME,
                    include_dashboard=False,
                    log_to_driver=False,
                )
        except BaseException as exc:  # handed to the constructor's caller
            self._error = exc
            return
        finally:
            self._started.set()
        self._closed.wait()
        ray.shutdown()

    def close(self, timeout: float = 30.0) -> None:
        """Delete the engine deployment and leave the cluster (a local one stops)."""
        try:
            serve.delete(APP_NAME)
        finally:
            self._closed.set()
            self._thread.join(timeout)


def start_replicas(
    settings: Settings, config: EngineConfig, pinned_ids: list[int]
) -> DeploymentHandle:
    """Run the engine deployment on the connected cluster: ``settings.replicas`` replicas of
    ``config``, each pinning ``pinned_ids``, routed by prefix affinity. Serve's own HTTP proxy
    stays off: the FastAPI app is the ingress."""
    serve.start(proxy_location="Disabled")
    router = RequestRouterConfig.model_validate(
        {
            "request_router_class": PrefixAffinityRouter,
            "request_router_kwargs": {
                "block_size": config.block_size,
                "imbalance_threshold": settings.replica_imbalance_threshold,
                "routing": settings.replica_routing,
            },
            "request_routing_stats_period_s": 1.0,
            "request_routing_stats_timeout_s": 10.0,
        }
    )
    deployment = serve.deployment(
        name=DEPLOYMENT_NAME,
        num_replicas=settings.replicas,
        # the engine batches continuously: a replica takes what LLMService admits
        max_ongoing_requests=settings.max_queued_requests,
        ray_actor_options={
            "num_cpus": settings.replica_num_cpus,
            "num_gpus": settings.replica_num_gpus,
        },
        request_router_config=router,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
    )(EngineReplica)
    return serve.run(deployment.bind(config, pinned_ids), name=APP_NAME, route_prefix=None)


def list_replicas() -> list[dict[str, Any]]:
    """Every replica of the engine deployment that Serve knows: id and state (RUNNING,
    STARTING, ...), with its pid and node."""
    # NOTE: Serve's public status counts replicas by state but names none; the controller's
    # instance details (what the dashboard shows) do.
    client = serve.context._get_global_client()
    if client is None:
        return []
    details: dict[str, Any] = ray.get(client._controller.get_serve_instance_details.remote())
    app = details.get("applications", {}).get(APP_NAME, {})
    deployment = app.get("deployments", {}).get(DEPLOYMENT_NAME, {})
    return [
        {
            "replica_id": r["replica_id"],
            # the state's name (RUNNING), not the enum's repr (ReplicaState.RUNNING)
            "state": str(getattr(r["state"], "value", r["state"])),
            "pid": r.get("pid"),
            "actor_name": r.get("actor_name"),
            "node_id": r.get("node_id"),
        }
        for r in deployment.get("replicas", [])
    ]


class RemoteEngine:
    """The part of AsyncEngine that LLMService and the app use, served by engine replicas."""

    def __init__(
        self,
        connection: RayConnection,
        handle: DeploymentHandle,
        tokenizer: Tokenizer,
        *,
        block_size: int,
        pinned_ids: Sequence[int] = (),
    ) -> None:
        self.connection = connection
        self.handle = handle
        self.tokenizer = tokenizer
        self.pinned_ids = list(pinned_ids)
        # every drop sent, and the replicas known to have seen all of them: a replica that
        # Ray starts again (a new id) gets the log replayed before it is counted as synced
        self._drop_log: deque[tuple[str, str]] = deque(maxlen=DROP_LOG_LEN)
        self._synced: set[str] = set()
        self._missed: set[str] = set()  # replicas a drop failed on since their last replay
        self._drop_lock = threading.Lock()
        first = self._describe_all()
        if not first:
            raise ReplicaUnavailableError("no engine replica is running", REPLICA_RETRY_AFTER_S)
        info = next(iter(first.values()))
        self.max_model_len: int = info["max_model_len"]
        self.num_kv_blocks: int = info["num_kv_blocks"]
        self._num_pinned: int = info["num_pinned_tokens"]
        # what this ingress sent, as one pseudo-replica: the prefix a follow-up can expect to
        # find cached (its router sends it where that prefix went)
        self._sent: PrefixAffinityPolicy[str] = PrefixAffinityPolicy(
            AffinityConfig(block_size=block_size)
        )

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        cache_scope: CacheScope = CacheScope(),
        chunk_spans: tuple[ChunkSpan, ...] = (),
    ) -> AsyncIterator[GenerationDelta | GenerationResult]:
        """The stream of the replica the router picks. ReplicaUnavailableError (503, with
        Retry-After) when that replica dies or cannot be reached."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._sent.record("sent", self._sent.prefix_keys(prompt_ids, cache_scope))
        stream = cast(
            DeploymentResponseGenerator,
            self.handle.options(stream=True).generate.remote(
                prompt_ids=prompt_ids,
                params=params,
                cache_scope=cache_scope,
                chunk_spans=chunk_spans,
            ),
        )
        try:
            async for item in stream:
                yield item
        except REPLICA_ERRORS as exc:
            logger.warning("an engine replica failed mid-request: %s", exc)
            raise ReplicaUnavailableError(
                "the engine replica serving this request stopped; retry", REPLICA_RETRY_AFTER_S
            ) from exc
        finally:
            stream.cancel()

    async def pin_prefix(
        self, token_ids: Sequence[int], cache_scope: CacheScope = CacheScope()
    ) -> int:
        """Replicas pin their prefix as they start (a restarted one too): only that one."""
        if list(token_ids) != self.pinned_ids or cache_scope != CacheScope():
            raise ValueError("engine replicas pin only the prefix they were started with")
        return self._num_pinned

    def cached_prefix_len(
        self, token_ids: Sequence[int], cache_scope: CacheScope = CacheScope()
    ) -> int:
        """Leading tokens of ``token_ids`` likely cached: the pinned public head, then the
        blocks of prompts this ingress sent before (an estimate; it cannot see evictions)."""
        block_size = self._sent.config.block_size
        num_public = cache_scope.num_public_blocks(block_size) * block_size
        if token_ids[:num_public] != self.pinned_ids[:num_public]:
            return 0
        keys = self._sent.prefix_keys(token_ids, cache_scope)
        return num_public + self._sent.num_matched_blocks("sent", keys) * block_size

    async def drop_chunks(self, namespace: str, tag: str) -> int:
        """Drop a deleted document's chunk bodies on every live replica. A replica that dies
        meanwhile is skipped, never failing the delete (the document is already gone from the
        database): it gets the drop replayed when it runs again (see ``_replay_drops``)."""
        with self._drop_lock:
            self._drop_log.append((namespace, tag))
        total = 0
        for replica in list_replicas():
            if not replica["state"].endswith("RUNNING"):
                continue
            target = replica["replica_id"]
            response = cast(
                DeploymentResponse, self.handle.drop_chunks.remote(namespace, tag, target=target)
            )
            try:
                total += await asyncio.wait_for(_awaited(response), DROP_TIMEOUT_S)
            except (*REPLICA_ERRORS, ray.exceptions.RayTaskError, TimeoutError) as exc:
                response.cancel()
                logger.warning("replica %s missed a chunk drop (%s); replayed later", target, exc)
                with self._drop_lock:
                    self._synced.discard(target)
                    self._missed.add(target)
        return total

    def stats(self) -> dict[str, int]:
        """Every replica's cache counters and gauges, summed."""
        total: dict[str, int] = {}
        for stats in self.stats_by_replica().values():
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total

    def stats_by_replica(self) -> dict[str, dict[str, int]]:
        """Each running replica's cache counters and gauges, by replica name (blocking: call
        it off the event loop)."""
        by_name = {}
        for replica_id, info in self._describe_all().items():
            stats = self.handle.stats.remote(target=replica_id).result(timeout_s=10)
            by_name[info["name"]] = stats
        return by_name

    def replicas(self) -> list[dict[str, Any]]:
        """Every replica Serve knows, with what a running one says of itself (blocking)."""
        try:
            described = self._describe_all()
            return [{**r, **described.get(r["replica_id"], {})} for r in list_replicas()]
        except Exception as exc:  # /readyz must answer even when the cluster does not
            logger.exception("cannot list the engine replicas")
            return [{"state": f"error: {type(exc).__name__}: {exc}"}]

    def shutdown(self, timeout: float = 10.0) -> None:
        self.connection.close(timeout)

    def _describe_all(self) -> dict[str, dict[str, Any]]:
        described = {}
        for replica in list_replicas():
            if not replica["state"].endswith("RUNNING"):
                continue
            target = replica["replica_id"]
            try:
                described[target] = self.handle.describe.remote(target=target).result(timeout_s=10)
                self._replay_drops(target)
            except Exception as exc:  # a replica dying now is reported, not fatal
                logger.warning("replica %s did not answer: %s", target, exc)
        return described

    def _replay_drops(self, target: str) -> None:
        """Send every logged drop to a replica not yet known to have seen them all (one Ray
        restarted, whose disk tier may still hold a deleted document's bodies)."""
        with self._drop_lock:
            if target in self._synced:
                return
            self._missed.discard(target)
            pending = list(self._drop_log)
        if pending:
            dropped = self.handle.drop_chunk_tags.remote(pending, target=target).result(
                timeout_s=60
            )
            logger.info("replayed %d chunk drops to %s: %d bodies", len(pending), target, dropped)
        with self._drop_lock:
            # a drop logged since the snapshot went to this replica through drop_chunks; if
            # that failed, the replica stays unsynced and the next look replays again
            if target not in self._missed:
                self._synced.add(target)


async def _awaited(response: DeploymentResponse) -> Any:
    return await response
