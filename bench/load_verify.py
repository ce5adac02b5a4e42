"""After the load: wait for ingestion to settle, then account for every accepted upload.

Lost: an id the server accepted (201/202) that it no longer knows (404). Half-ingested: a
document still pending/processing when the settle time ran out, or `ready` with no chunk
that a search restricted to it can find.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

TERMINAL = frozenset({"ready", "failed"})
_CONCURRENCY = 4


async def _status(client: httpx.AsyncClient, document_id: int) -> dict[str, Any] | None:
    reply = await client.get(f"/v1/documents/{document_id}")
    if reply.status_code == 404:
        return None
    reply.raise_for_status()
    return dict(reply.json())


async def _gather_limited(coros: Sequence[Any]) -> list[Any]:
    gate = asyncio.Semaphore(_CONCURRENCY)

    async def one(coro: Any) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(one(c) for c in coros))


async def settle(
    client: httpx.AsyncClient, ids: Sequence[int], timeout_s: float, poll_s: float = 1.0
) -> tuple[dict[int, dict[str, Any] | None], float]:
    """Each id's last document body (None when 404) once all are terminal or time ran out,
    and the seconds that took."""
    t0 = time.perf_counter()
    last: dict[int, dict[str, Any] | None] = {}
    waiting = list(dict.fromkeys(ids))
    while waiting:
        bodies = await _gather_limited([_status(client, i) for i in waiting])
        last.update(zip(waiting, bodies, strict=True))
        waiting = [
            i for i, b in zip(waiting, bodies, strict=True) if b and b["status"] not in TERMINAL
        ]
        if not waiting or time.perf_counter() - t0 > timeout_s:
            break
        # NOTE: polling the documented status field; ingestion has no completion callback.
        await asyncio.sleep(poll_s)
    return last, time.perf_counter() - t0


async def _is_searchable(client: httpx.AsyncClient, doc: dict[str, Any]) -> bool:
    body = {"query": doc["title"], "top_k": 1, "document_ids": [doc["id"]]}
    reply = await client.post("/v1/search", json=body)
    reply.raise_for_status()
    return bool(reply.json()["results"])


async def verify_documents(
    client: httpx.AsyncClient, ids: Sequence[int], settle_timeout_s: float
) -> dict[str, Any]:
    """Counts of ready, failed (with reasons), lost and half-ingested accepted uploads."""
    last, settle_s = await settle(client, ids, settle_timeout_s)
    docs = [b for b in last.values() if b is not None]
    ready = [d for d in docs if d["status"] == "ready"]
    failed = [d for d in docs if d["status"] == "failed"]
    stuck = [d["id"] for d in docs if d["status"] not in TERMINAL]
    found = await _gather_limited([_is_searchable(client, d) for d in ready])
    unsearchable = [d["id"] for d, ok in zip(ready, found, strict=True) if not ok]
    lost = [i for i, b in last.items() if b is None]
    return {
        "num_accepted": len(last),
        "num_ready": len(ready),
        "num_failed": len(failed),
        "failed_reasons": dict(Counter(str(d.get("error")) for d in failed)),
        "num_lost": len(lost),
        "num_half": len(stuck) + len(unsearchable),
        "lost_ids": lost[:20],
        "stuck_ids": stuck[:20],
        "unsearchable_ids": unsearchable[:20],
        "settle_s": settle_s,
    }
