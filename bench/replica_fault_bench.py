"""A replica killed under load: what users see, and whether any document update is lost.

    python -m bench.replica_fault_bench                  # 60 s of load, a replica killed at 20 s
    python -m bench.replica_fault_bench --duration 20 --kill-at 8   # a smoke run

One app with 2 engine replicas on a local Ray cluster (the ingress in this process, as
bench/replica_bench.py runs it), over two ingested pages of the Python docs. For `--duration`
seconds, `--clients` threads ask /v1/query without pause (greedy, short answers) while a writer
uploads a small Markdown document every `--write-every` seconds, each with a unique marker word,
and deletes the oldest of its live uploads every other time. At `--kill-at` seconds the replica
with the most requests in flight is killed (`ray.kill`, Ray restarts it), and /readyz is
polled twice a second throughout.

Issue 18's goals, checked from what the clients saw:
- 0 lost documents: every upload that was acknowledged (201, ready) and not deleted is listed
  and found by a search for its marker; every acknowledged delete is gone (404, not found);
- 0 server errors (5xx) except on requests in flight when the replica died;
- the service back within 30 s: /readyz shows 2 running replicas again, the dead one replaced
  (also reported: the first answer started after the kill).

Writes bench/results/replica_fault_bench.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from bench.rag_bench import (
    CONVERSATIONS,
    DOC_ROOT,
    MODEL_CACHE,
    RESULTS,
    code_state,
    ingest,
    link_model_cache,
    make_settings,
    started_client,
)
from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.retrieval.embedder import Embedder

PAGES = ("json.html", "csv.html")
BACK_WITHIN_S = 30.0
WATCH_S = 180.0  # how long after the kill the bench waits for the replacement


@dataclass
class Call:
    """One request as its client saw it; times in seconds from the start of the load."""

    kind: str  # query | upload | delete
    start: float
    end: float
    status: int
    retry_after: str | None = None
    document_id: int | None = None
    marker: str | None = None
    error: str | None = None


class Load:
    """The clients, the writer, the poller and the kill, sharing one clock and one record."""

    def __init__(self, client: TestClient, args: argparse.Namespace) -> None:
        self.client = client
        self.args = args
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.polls: list[dict[str, Any]] = []
        self.kill: dict[str, Any] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, call: Call) -> None:
        with self.lock:
            self.calls.append(call)

    def asker(self, index: int) -> None:
        questions = [q for page in PAGES for q in CONVERSATIONS[page]]
        i = index
        while not self.stop.is_set():
            body = {"question": questions[i % len(questions)], "top_k": 3, "max_tokens": 12}
            start = self.now()
            response = self.client.post("/v1/query", json={**body, "temperature": 0})
            error = None if response.status_code == 200 else response.text[:200]
            self.record(
                Call(
                    "query",
                    start,
                    self.now(),
                    response.status_code,
                    response.headers.get("Retry-After"),
                    error=error,
                )
            )
            i += self.args.clients

    def writer(self) -> None:
        live: list[Call] = []
        n = 0
        next_at = 0.0
        while not self.stop.wait(max(0.0, next_at - self.now())):
            next_at = self.now() + self.args.write_every
            n += 1
            marker = f"zq{uuid.uuid4().hex[:10]}"
            text = (
                f"# Fault note {n}\n\nThe maintenance code for this note is {marker}. "
                f"It was written {n} steps into a load run, while engine replicas answered "
                "questions about the json and csv modules.\n"
            )
            upload = {"file": (f"note-{n}.md", text.encode(), "text/markdown")}
            start = self.now()
            response = self.client.post("/v1/documents?wait=true", files=upload)
            ok = response.status_code == 201 and response.json().get("status") == "ready"
            call = Call(
                "upload",
                start,
                self.now(),
                response.status_code,
                document_id=response.json().get("id") if ok else None,
                marker=marker,
                error=None if ok else response.text[:200],
            )
            self.record(call)
            if ok:
                live.append(call)
            if n % 2 == 0 and len(live) > 1:
                victim = live.pop(0)
                start = self.now()
                response = self.client.delete(f"/v1/documents/{victim.document_id}")
                self.record(
                    Call(
                        "delete",
                        start,
                        self.now(),
                        response.status_code,
                        document_id=victim.document_id,
                        marker=victim.marker,
                        error=None if response.status_code == 204 else response.text[:200],
                    )
                )

    def poller(self) -> None:
        while not self.stop.wait(0.5):
            at = self.now()
            replicas = self.readyz_replicas()
            self.polls.append({"t": at, "replicas": replicas})
            if not self.kill and at >= self.args.kill_at:
                self.kill_busiest(replicas)

    def kill_busiest(self, replicas: list[dict[str, Any]]) -> None:
        import ray

        running = [r for r in replicas if r.get("state", "").endswith("RUNNING")]
        victim = max(running, key=lambda r: r.get("num_active", 0))
        self.kill = {
            "t": self.now(),
            "replica_id": victim["replica_id"],
            "name": victim.get("name"),
            "num_active": victim.get("num_active", 0),
        }
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=False)
        print(f"killed {victim.get('name')} at {self.kill['t']:.1f} s", flush=True)

    def run(self) -> None:
        threads = [threading.Thread(target=self.asker, args=(i,)) for i in range(self.args.clients)]
        threads += [threading.Thread(target=self.writer), threading.Thread(target=self.poller)]
        for thread in threads:
            thread.start()
        self.stop.wait(self.args.duration)
        self.stop.set()
        for thread in threads:
            thread.join()
        # past the load, keep watching until the dead replica is replaced (or a limit)
        while self.kill and not self.replaced() and self.now() < self.kill["t"] + WATCH_S:
            time.sleep(0.5)
            self.polls.append({"t": self.now(), "replicas": self.readyz_replicas()})

    def readyz_replicas(self) -> list[dict[str, Any]]:
        return self.client.get("/readyz").json().get("replicas", [])

    def replaced(self) -> bool:
        """The last poll shows 2 running replicas, the killed one not among them."""
        if not self.polls:
            return False
        running = [r for r in self.polls[-1]["replicas"] if r.get("state", "").endswith("RUNNING")]
        ids = {r.get("replica_id") for r in running}
        return len(running) == 2 and self.kill.get("replica_id") not in ids


def check_documents(client: TestClient, calls: list[Call]) -> dict[str, Any]:
    """Every acknowledged upload that was not deleted is there and searchable; every
    acknowledged delete is gone from the rows and from search."""
    deleted = {c.document_id for c in calls if c.kind == "delete" and c.status == 204}
    kept = [c for c in calls if c.kind == "upload" and c.document_id is not None]
    missing, lingering = [], []
    for call in kept:
        status = client.get(f"/v1/documents/{call.document_id}").status_code
        found = marker_hits(client, call.marker or "")
        if call.document_id in deleted:
            if status != 404 or call.document_id in found:
                lingering.append(call.document_id)
        elif status != 200 or call.document_id not in found:
            missing.append(call.document_id)
    return {
        "acknowledged_uploads": len(kept),
        "acknowledged_deletes": len(deleted),
        "lost_uploads": missing,
        "deletes_not_applied": lingering,
        "lost_documents": len(missing) + len(lingering),
    }


def marker_hits(client: TestClient, marker: str) -> set[int]:
    response = client.post("/v1/search", json={"query": marker, "top_k": 5})
    response.raise_for_status()
    return {hit["document_id"] for hit in response.json()["results"] if marker in hit["text"]}


def analyse(load: Load, documents: dict[str, Any]) -> dict[str, Any]:
    kill_t = load.kill.get("t")
    calls = load.calls

    def in_flight(c: Call) -> bool:
        return kill_t is not None and c.start <= kill_t <= c.end

    errors = [c for c in calls if c.status >= 500]
    other_errors = [c for c in errors if not in_flight(c)]
    queries = [c for c in calls if c.kind == "query"]
    back = answering = None
    if kill_t is not None:
        for poll in load.polls:
            running = [r for r in poll["replicas"] if r.get("state", "").endswith("RUNNING")]
            ids = {r.get("replica_id") for r in running}
            if poll["t"] > kill_t and len(running) == 2 and load.kill["replica_id"] not in ids:
                back = poll["t"] - kill_t
                break
        after = [c for c in queries if c.start > kill_t and c.status == 200]
        answering = min((c.end - kill_t for c in after), default=None)
    goals = [
        goal("lost documents", documents["lost_documents"], "0", documents["lost_documents"] == 0),
        goal(
            "5xx outside the dead replica's in-flight requests",
            len(other_errors),
            "0",
            not other_errors,
        ),
        goal(
            "replicas back (2 running, dead one replaced), s after the kill",
            back,
            f"<= {BACK_WITHIN_S:.0f}",
            back is not None and back <= BACK_WITHIN_S,
        ),
    ]
    return {
        "kill": load.kill,
        "requests": {
            "queries": len(queries),
            "queries_ok": sum(c.status == 200 for c in queries),
            "uploads": sum(c.kind == "upload" for c in calls),
            "deletes": sum(c.kind == "delete" for c in calls),
            "in_flight_at_kill": sum(in_flight(c) for c in calls),
            "errors_in_flight": [asdict(c) for c in errors if in_flight(c)],
            "errors_other": [asdict(c) for c in other_errors],
            "in_flight_503_with_retry_after": sum(
                in_flight(c) and c.status == 503 and bool(c.retry_after) for c in calls
            ),
        },
        "replicas_back_s": back,
        "first_answer_after_kill_s": answering,
        "documents": documents,
        "goals": goals,
        "timeline": [
            {
                "t": round(p["t"], 2),
                "states": {r.get("replica_id", "?"): r.get("state") for r in p["replicas"]},
            }
            for p in load.polls
        ],
    }


def goal(name: str, value: Any, target: str, met: bool) -> dict[str, Any]:
    return {"goal": name, "value": value, "target": target, "met": met}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--kill-at", type=float, default=20.0, help="seconds into the load")
    parser.add_argument("--clients", type=int, default=3, help="threads asking /v1/query")
    parser.add_argument("--write-every", type=float, default=2.0, help="seconds between uploads")
    parser.add_argument("--kv-gb", type=float, default=0.5, help="KV pool of each replica")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    code = code_state()
    embedder = Embedder(packaged_embedder_path())
    with tempfile.TemporaryDirectory(prefix="replica-fault-") as tmp:
        data_dir = Path(tmp) / "data"
        ingest(data_dir, embedder, {p: DOC_ROOT / p for p in PAGES})
        models = MODEL_CACHE if MODEL_CACHE.is_dir() else Path(tmp) / "models"
        models.mkdir(parents=True, exist_ok=True)
        link_model_cache(data_dir, models)
        settings = make_settings(data_dir, True, args.kv_gb).model_copy(
            update={"replicas": 2, "replica_num_cpus": 0.5}
        )
        client = started_client(settings, embedder)
        try:
            load = Load(client, args)
            print(f"load for {args.duration:.0f} s, kill at {args.kill_at:.0f} s", flush=True)
            load.run()
            report = analyse(load, check_documents(client, load.calls))
        finally:
            client.__exit__(None, None, None)
    payload = {"args": vars(args), "code": code, **report}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "replica_fault_bench.json"
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print_summary(payload)
    print(f"wrote {out}")


def print_summary(payload: dict[str, Any]) -> None:
    r = payload["requests"]
    kill = payload["kill"]
    print(
        f"queries {r['queries']} ({r['queries_ok']} ok), uploads {r['uploads']}, "
        f"deletes {r['deletes']}; killed {kill.get('name')} at {kill.get('t', 0):.1f} s with "
        f"{kill.get('num_active')} active; {r['in_flight_at_kill']} requests in flight, "
        f"{len(r['errors_in_flight'])} of them failed ({r['in_flight_503_with_retry_after']} "
        "503 + Retry-After)"
    )
    answer = payload["first_answer_after_kill_s"]
    if answer is not None:
        print(f"first answer started after the kill: {answer:.1f} s after it")
    for g in payload["goals"]:
        verdict = "met" if g["met"] else "NOT met"
        value = "-" if g["value"] is None else g["value"]
        value = f"{value:.1f}" if isinstance(value, float) else value
        print(f"{g['goal']}: {value} (goal {g['target']}) {verdict}")


if __name__ == "__main__":
    main()
