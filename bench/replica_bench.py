"""Engine replicas on Ray Serve: how much of the prompt the cache serves with prefix-affinity
routing, with round-robin routing, and with one engine, on rag_bench's follow-up workload.

    python -m bench.replica_bench                # 4 conversations x 3 turns, 3 configurations
    python -m bench.replica_bench --rounds 2 --pages 2   # a smoke run

Each configuration gets its own app on its own copy of one ingested data dir, run one after
another (one Ray cluster per process): `one` (PREFIXRAG_REPLICAS=1, the embedded engine),
`prefix2` (2 replicas on a local Ray cluster, prefix-affinity routing) and `round_robin2` (2
replicas, round-robin). The conversations run side by side, one thread each, every request
sending the earlier turns back in `history` (so its prompt extends the previous turn's), through
the real HTTP route (/v1/query, in-process client). Greedy answers.

Measures: cached share of prompt tokens (cached / prompt, over all turns after the first of each
conversation, and over all turns), wall time and requests/s, and how each replica's prompt
tokens split (from /metrics). Goal (issue 18): prefix2's follow-up cached share >= 0.9x one's.
Throughput: every engine runs `--threads` threads (1 by default: Ray starts replicas with
OMP_NUM_THREADS=1, and this process sets torch's threads for the embedded engine), so on 2
cores one engine leaves a core to the rest while 2 replicas use both; the ingress (retrieval,
the embedder) shares them. Measured: requests/s, 2 replicas / 1 engine. Projected for a machine
with a core per replica and one for the ingress: from the CPU seconds each process spent per
request (this process for the ingress; each replica's process, by its pid on /readyz), the
busiest replica and the ingress bound the rate (see `projection`).

Writes bench/results/replica_bench.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from bench.rag_bench import (
    CONVERSATIONS,
    DOC_ROOT,
    MODEL_CACHE,
    RESULTS,
    code_state,
    copy_data_dir,
    ingest,
    link_model_cache,
    make_settings,
    started_client,
)
from prefixrag.app.core.settings import packaged_embedder_path
from prefixrag.retrieval.embedder import Embedder

CONFIGS = [  # name, replicas, routing
    ("one", 1, "prefix"),
    ("prefix2", 2, "prefix"),
    ("round_robin2", 2, "round_robin"),
]
QUERIED = re.compile(r'^prefixrag_prefix_cache_queried_tokens_total\{replica="([^"]+)"\} (\S+)$')
GOAL_RATIO = 0.9


def run_config(
    name: str,
    replicas: int,
    routing: str,
    data_dir: Path,
    embedder: Embedder,
    page_ids: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    settings = make_settings(data_dir, True, args.kv_gb).model_copy(
        update={
            "replicas": replicas,
            "replica_routing": routing,
            "replica_num_cpus": 0.5,
            "chunk_disk_gb": 0.0,
        }
    )
    client = started_client(settings, embedder)
    try:
        pids = replica_pids(client)
        cpu_before = process_cpu(pids)
        ingress_before = time.process_time()
        started = time.perf_counter()
        with ThreadPoolExecutor(len(page_ids)) as pool:
            futures = [
                pool.submit(conversation, client, page, doc_id, args)
                for page, doc_id in page_ids.items()
            ]
            rows = [row for future in futures for row in future.result()]
        wall_s = time.perf_counter() - started
        ingress_cpu_s = time.process_time() - ingress_before
        replica_cpu_s = {
            pid: after - cpu_before.get(pid, 0.0) for pid, after in process_cpu(pids).items()
        }
        split = queried_by_replica(client)
    finally:
        client.__exit__(None, None, None)
    return {
        "replicas": replicas,
        "routing": routing,
        "wall_s": wall_s,
        "requests_per_s": len(rows) / wall_s,
        "cached_share_all": share(rows),
        "cached_share_follow_ups": share([r for r in rows if r["turn"] > 1]),
        "queried_tokens_by_replica": split,
        "ingress_cpu_s": ingress_cpu_s,
        "replica_cpu_s": list(replica_cpu_s.values()),
        "rows": rows,
    }


def replica_pids(client: TestClient) -> list[int]:
    """The engine replicas' processes (none for the embedded engine)."""
    return [r["pid"] for r in client.get("/readyz").json().get("replicas", []) if "pid" in r]


def process_cpu(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process so far (its threads included)."""
    import psutil

    found = {}
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        found[pid] = times.user + times.system
    return found


def projection(replicated: dict[str, Any]) -> dict[str, Any]:
    """Throughput of N replicas on a machine with a core per replica and one for the ingress,
    against one replica there, from CPU seconds per request: the busiest replica serves its
    share of the requests at its cost, and the ingress serves all of them at its own."""
    n = len(replicated["replica_cpu_s"])
    requests = len(replicated["rows"])
    replica_total = sum(replicated["replica_cpu_s"])
    if not n or not requests or not replica_total:
        return {}
    per_request = replica_total / requests
    busiest_share = max(replicated["replica_cpu_s"]) / replica_total
    ingress = replicated["ingress_cpu_s"] / requests
    one = min(1 / per_request, 1 / ingress)
    many = min(1 / (busiest_share * per_request), 1 / ingress)
    return {
        "replica_cpu_s_per_request": per_request,
        "ingress_cpu_s_per_request": ingress,
        "busiest_replica_share": busiest_share,
        "projected_ratio": many / one,
    }


def conversation(
    client: TestClient, page: str, doc_id: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = []
    rows = []
    for turn, question in enumerate(CONVERSATIONS[page][: args.rounds], start=1):
        body = {
            "question": question,
            "document_ids": [doc_id],
            "top_k": args.top_k,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "history": history,
        }
        response = client.post("/v1/query", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{page} turn {turn}: {response.status_code} {response.text}")
        out = response.json()
        rows.append({"page": page, "turn": turn, **out["usage"], **out["timings"]})
        history.append(
            {"question": question, "answer": out["answer"], "chunk_ids": out["chunk_ids"]}
        )
    return rows


def share(rows: list[dict[str, Any]]) -> float:
    prompt = sum(r["prompt_tokens"] for r in rows)
    return sum(r["cached_tokens"] for r in rows) / prompt if prompt else 0.0


def queried_by_replica(client: TestClient) -> dict[str, float]:
    found = {}
    for line in client.get("/metrics").text.splitlines():
        match = QUERIED.match(line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="questions per conversation")
    parser.add_argument("--pages", type=int, default=4, help="conversations (1-4)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--kv-gb", type=float, default=1.5, help="KV pool of each engine")
    parser.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    # the embedded engine's threads (and this process's); replicas get Ray's OMP_NUM_THREADS
    torch.set_num_threads(args.threads)
    wanted = set(args.configs.split(","))
    code = code_state()
    embedder = Embedder(packaged_embedder_path())
    pages = list(CONVERSATIONS)[: args.pages]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="replica-bench-") as tmp:
        workdir = Path(tmp)
        base = workdir / "base"
        doc_ids = ingest(base, embedder, {p: DOC_ROOT / p for p in pages})
        models = MODEL_CACHE if MODEL_CACHE.is_dir() else workdir / "models"
        models.mkdir(parents=True, exist_ok=True)
        link_model_cache(base, models)
        for name, replicas, routing in CONFIGS:
            if name not in wanted:
                continue
            data_dir = copy_data_dir(base, workdir / name)
            print(f"running {name} ...", flush=True)
            results[name] = run_config(name, replicas, routing, data_dir, embedder, doc_ids, args)
    payload = {"args": vars(args), "code": code, "configs": results}
    if "one" in results and "prefix2" in results:
        one = results["one"]["cached_share_follow_ups"]
        ratio = results["prefix2"]["cached_share_follow_ups"] / one if one else 0.0
        payload["goal"] = {
            "goal": "prefix2 follow-up cached share / one's",
            "value": ratio,
            "target": f">= {GOAL_RATIO}",
            "met": ratio >= GOAL_RATIO,
        }
        measured = results["prefix2"]["requests_per_s"] / results["one"]["requests_per_s"]
        payload["throughput"] = {
            "measured_ratio_2_cores": measured,
            "projection": projection(results["prefix2"]),
            "target": ">= 1.8",
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "replica_bench.json").write_text(json.dumps(payload, indent=2))
    print_summary(payload)


def print_summary(payload: dict[str, Any]) -> None:
    print(f"{'config':<14}{'follow-up cached':>18}{'all cached':>12}{'req/s':>8}  per replica")
    for name, r in payload["configs"].items():
        split = ", ".join(f"{k}={v:.0f}" for k, v in r["queried_tokens_by_replica"].items())
        print(
            f"{name:<14}{r['cached_share_follow_ups']:>18.3f}{r['cached_share_all']:>12.3f}"
            f"{r['requests_per_s']:>8.3f}  {split or '(embedded)'}"
        )
    throughput = payload.get("throughput")
    if throughput:
        projected = throughput["projection"].get("projected_ratio", float("nan"))
        print(
            f"throughput 2 replicas / 1 engine: {throughput['measured_ratio_2_cores']:.2f}x "
            f"measured on this machine's cores, {projected:.2f}x projected with a core each "
            f"(goal {throughput['target']})"
        )
    goal = payload.get("goal")
    if goal:
        verdict = "met" if goal["met"] else "NOT met"
        print(f"{goal['goal']}: {goal['value']:.3f} ({goal['target']}) {verdict}")


if __name__ == "__main__":
    main()
