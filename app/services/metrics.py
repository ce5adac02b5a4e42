"""Prometheus metrics of one app, in a registry that app owns (no global registry state).

Request counts and latencies come from an ASGI middleware (app/api/metrics_middleware.py);
TTFT, TPOT and retrieval stage latencies are observed by the Q&A service; prefix-cache counters,
KV block occupancy and documents/chunks by status are read from the engine and the database at
scrape time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from prefixrag.app.core.models import Chunk, Document
from prefixrag.engine.outputs import GenerationResult

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from prefixrag.app.services.llm import LLMService

# Components load after the app starts: the collectors ask for them at scrape time.
LLMSource = Callable[[], "LLMService | None"]
SessionsSource = Callable[[], "sessionmaker[Session] | None"]

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
KV_BLOCK_STATES = ("used", "free", "pinned", "cached")


class Metrics:
    """Every series the service exports; `render()` is the /metrics body."""

    def __init__(self, *, llm: LLMSource, sessions: SessionsSource) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "prefixrag_http_requests", "HTTP requests", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "prefixrag_http_request_duration_seconds",
            "HTTP request latency, until the last byte of the response",
            ["route", "method"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft = Histogram(
            "prefixrag_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.tpot = Histogram(
            "prefixrag_tpot_seconds", "time per output token", buckets=TOKEN_BUCKETS_S, registry=r
        )
        self.stages = {
            stage: Histogram(
                f"prefixrag_{stage}_seconds",
                f"retrieval {stage} latency",
                buckets=LATENCY_BUCKETS_S,
                registry=r,
            )
            for stage in ("embed", "search", "rerank")
        }
        r.register(EngineCollector(llm))
        r.register(DocumentCollector(sessions))

    def observe_retrieval(self, timings_ms: dict[str, float]) -> None:
        """Record the embed/search/rerank times of one retrieval (given in ms)."""
        for stage, histogram in self.stages.items():
            if f"{stage}_ms" in timings_ms:
                histogram.observe(timings_ms[f"{stage}_ms"] / 1000.0)

    def observe_generation(self, result: GenerationResult) -> None:
        """Record one finished generation's TTFT and (if it decoded more than one token) TPOT."""
        self.ttft.observe(result.ttft_s)
        if result.completion_tokens > 1:
            self.tpot.observe(result.tpot_s)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Prefix-cache token counters, KV block gauges and the chunk store's series, read from the
    engine at scrape time; with engine replicas, one series per replica (label ``replica``)."""

    def __init__(self, llm: LLMSource) -> None:
        self.llm = llm

    def collect(self) -> Iterator[Metric]:
        llm = self.llm()
        if llm is None:
            return
        try:
            by_replica = llm.engine_stats()
        except Exception:  # a scrape must not fail because a replica is restarting
            logger.exception("cannot read engine stats for /metrics")
            return
        # the embedded engine is "" and keeps today's unlabelled series
        names = ["replica"] if any(by_replica) else []
        queried = CounterMetricFamily(
            "prefixrag_prefix_cache_queried_tokens",
            "prompt tokens looked up in the prefix cache",
            labels=names,
        )
        hit = CounterMetricFamily(
            "prefixrag_prefix_cache_hit_tokens",
            "prompt tokens served from the prefix cache",
            labels=names,
        )
        blocks = GaugeMetricFamily(
            "prefixrag_kv_blocks", "KV cache blocks by state", labels=["state", *names]
        )
        for replica, stats in by_replica.items():
            values = [replica] if names else []
            queried.add_metric(values, stats["queried_tokens"])
            hit.add_metric(values, stats["hit_tokens"])
            for name in KV_BLOCK_STATES:
                blocks.add_metric([name, *values], stats[f"blocks_{name}"])
        yield from (queried, hit, blocks)
        yield from _chunk_store_metrics(by_replica, names)


def _chunk_store_metrics(
    by_replica: dict[str, dict[str, int]], names: list[str]
) -> Iterator[Metric]:
    """The chunk KV store: lookups by outcome, evictions, and bytes held in each tier."""
    lookups = CounterMetricFamily(
        "prefixrag_chunk_store_lookups",
        "source bodies looked up in the chunk KV store, by outcome and the tier that served them",
        labels=["result", *names],
    )
    evictions = CounterMetricFamily(
        "prefixrag_chunk_store_evictions",
        "chunk entries evicted from a tier",
        labels=["tier", *names],
    )
    held = GaugeMetricFamily(
        "prefixrag_chunk_store_bytes", "bytes of chunk KV held, by tier", labels=["tier", *names]
    )
    entries = GaugeMetricFamily(
        "prefixrag_chunk_store_entries", "chunk entries held, by tier", labels=["tier", *names]
    )
    reused = CounterMetricFamily(
        "prefixrag_chunk_reuse_tokens",
        "prompt tokens of cached source bodies placed at new positions, by whether blending "
        "computed them again",
        labels=["kind", *names],
    )
    for replica, stats in by_replica.items():
        r = [replica] if names else []
        lookups.add_metric(["hit_pool", *r], stats["chunk_hits"])
        lookups.add_metric(["hit_host", *r], stats["chunk_host_hits"])
        lookups.add_metric(["hit_disk", *r], stats["chunk_disk_hits"])
        # a pool miss served by a slower tier is not a miss of the store
        misses = stats["chunk_misses"] - stats["chunk_host_hits"] - stats["chunk_disk_hits"]
        lookups.add_metric(["miss", *r], max(0, misses))
        evictions.add_metric(["pool", *r], stats["chunk_evictions"])
        evictions.add_metric(["host", *r], stats["chunk_host_evictions"])
        held.add_metric(["pool", *r], stats["chunk_pool_bytes"])
        held.add_metric(["host", *r], stats["chunk_host_bytes"])
        held.add_metric(["disk", *r], stats["chunk_disk_bytes"])
        entries.add_metric(["pool", *r], stats["chunk_entries"])
        entries.add_metric(["host", *r], stats["chunk_host_entries"])
        entries.add_metric(["disk", *r], stats["chunk_disk_files"])
        reused.add_metric(["blended", *r], stats["blended_tokens"])
        reused.add_metric(["recomputed", *r], stats["recomputed_tokens"])
    yield from (lookups, evictions, held, entries, reused)


class DocumentCollector(Collector):
    """Documents and chunks by document status, counted in the database at scrape time."""

    def __init__(self, sessions: SessionsSource) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        sessions = self.sessions()
        if sessions is None:
            return
        documents = GaugeMetricFamily(
            "prefixrag_documents", "documents by status", labels=["status"]
        )
        chunks = GaugeMetricFamily(
            "prefixrag_chunks", "chunks by their document's status", labels=["status"]
        )
        try:
            with sessions() as session:
                doc_rows = session.execute(
                    select(Document.status, func.count(Document.id)).group_by(Document.status)
                ).all()
                chunk_rows = session.execute(
                    select(Document.status, func.count(Chunk.id))
                    .join(Chunk, Chunk.document_id == Document.id)
                    .group_by(Document.status)
                ).all()
        except Exception:  # a scrape must not fail because the database hiccups
            logger.exception("cannot count documents for /metrics")
            return
        for status, count in doc_rows:
            documents.add_metric([status], count)
        for status, count in chunk_rows:
            chunks.add_metric([status], count)
        yield from (documents, chunks)
