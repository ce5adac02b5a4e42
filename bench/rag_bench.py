"""The RAG workload: 4 long Python docs pages, 40 questions, four ways in one run.

    python -m bench.rag_bench [--max-tokens 16] [--top-k 4]

Each page gets one conversation of 10 follow-up questions, scoped to that page (as a user who
opened it would ask), asked as one multi-turn conversation: every request sends the earlier
turns back in `history`, so its prompt extends the previous turn's prompt and answer. The
conversations are interleaved round by round (A1 B1 C1 D1 A2 ...) as on a shared service.
The same 40 questions run against a fresh app for each of: prefix cache
on/off x canonical/score ordering of the retrieved chunks. Requests go through the real HTTP
route (/v1/query, in-process client). Writes bench/results/rag_bench.json and rag_bench.png and
prints a summary. Goal: cache on + canonical has mean TTFT <= 1/3 of cache off and >= 60% of
prompt tokens served from the cache.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from tqdm import tqdm

from prefixrag.app.core.settings import Settings, packaged_embedder_path
from prefixrag.app.main import create_app
from prefixrag.app.prompt.builder import PromptBuilder, load_prompt_config
from prefixrag.retrieval.embedder import Embedder

DOC_ROOT = Path("/usr/share/doc/python3.11/html/library")
CONVERSATIONS: dict[str, list[str]] = {
    "json.html": [
        "How do I write a Python object to a file as JSON?",
        "What does the indent argument of dump do?",
        "How can I make the output keys sorted?",
        "What does ensure_ascii control?",
        "How do I serialize a type json does not support?",
        "What should a default function return?",
        "Can I make the separators more compact?",
        "What happens with circular references when check_circular is false?",
        "Is NaN allowed in the output?",
        "Which exception is raised for unserializable objects?",
    ],
    "csv.html": [
        "How do I read rows from a CSV file?",
        "Why should the file be opened with newline=''?",
        "How do I read rows as dictionaries keyed by the header?",
        "How do I write rows to a CSV file?",
        "How do I write dictionaries with DictWriter?",
        "What does writeheader do?",
        "How can I change the delimiter?",
        "What quoting options exist?",
        "What is a dialect?",
        "How does the Sniffer guess the format?",
    ],
    "functools.html": [
        "How does lru_cache memoize a function?",
        "What does maxsize do in lru_cache?",
        "How do I see cache hits and misses?",
        "How do I clear the cache of a cached function?",
        "What is the difference between cache and lru_cache?",
        "What does typed=True change?",
        "How is cached_property different from property?",
        "What does partial do?",
        "What is reduce used for?",
        "How do I write a single-dispatch generic function?",
    ],
    "shutil.html": [
        "How do I copy a file with shutil?",
        "What is the difference between copy and copy2?",
        "How do I copy a whole directory tree?",
        "How do I ignore some files when copying a tree?",
        "How do I delete a directory tree?",
        "How can rmtree handle errors?",
        "How do I move a file or directory?",
        "How do I find an executable on the PATH?",
        "How do I create a zip archive of a folder?",
        "How do I check free disk space?",
    ],
}
RUNS = [  # (name, prefix cache, chunk order)
    ("cache_on_canonical", True, "canonical"),
    ("cache_on_score", True, "score"),
    ("cache_off_canonical", False, "canonical"),
    ("cache_off_score", False, "score"),
]
RESULTS = Path(__file__).parent / "results"
MODEL_CACHE = Path(".pytest_cache/d/prefixrag-engine-models")


def interleaved(doc_ids: dict[str, int], num_rounds: int) -> list[tuple[str, int, str]]:
    """(page, document id, question), round by round across the conversations."""
    rounds = list(zip(*CONVERSATIONS.values(), strict=True))[:num_rounds]
    names = list(CONVERSATIONS)
    return [
        (n, doc_ids[n], q) for questions in rounds for n, q in zip(names, questions, strict=True)
    ]


def make_settings(data_dir: Path, prefix_cache: bool, kv_gb: float) -> Settings:
    return Settings(
        data_dir=data_dir,
        embed_model=packaged_embedder_path(),
        rerank_model="",  # no pretrained cross-encoder here; first-stage order
        kv_cache_gb=kv_gb,
        prefix_cache=prefix_cache,
        index_use_gpu="no",
        max_num_seqs=8,
        max_num_batched_tokens=1024,
    )


def started_client(settings: Settings, embedder: Embedder) -> TestClient:
    client = TestClient(create_app(settings, embedder=embedder))
    client.__enter__()
    if not client.app.state.prefixrag.wait_loaded(600):  # type: ignore[attr-defined]
        raise TimeoutError("the app did not finish loading")
    return client


def ingest(data_dir: Path, embedder: Embedder) -> dict[str, int]:
    client = started_client(
        make_settings(data_dir, True, 0.1).model_copy(update={"load_llm": False}), embedder
    )
    try:
        ids = {}
        for name in CONVERSATIONS:
            files = {"file": (name, (DOC_ROOT / name).read_bytes(), "text/html")}
            response = client.post("/v1/documents?wait=true", files=files)
            if response.status_code != 201 or response.json()["status"] != "ready":
                raise RuntimeError(f"ingest of {name} failed: {response.text}")
            ids[name] = response.json()["id"]
            print(f"ingested {name}: {response.json()['num_chunks']} chunks")
        return ids
    finally:
        client.__exit__(None, None, None)


def run_once(
    name: str, settings: Settings, order: str, embedder: Embedder, questions: list, args: Any
) -> list[dict[str, Any]]:
    client = started_client(settings, embedder)
    try:
        state = client.app.state.prefixrag  # type: ignore[attr-defined]
        if order == "score":
            state.prompts = PromptBuilder(
                state.llm.engine.tokenizer, load_prompt_config(), order="score"
            )
        # Warm-up (first torch calls) on a question with no sources: shares only the stable part.
        client.post(
            "/v1/query", json={"question": "warm up", "collection": "none", "max_tokens": 2}
        )
        rows = []
        histories: dict[str, list[dict[str, Any]]] = {page: [] for page in CONVERSATIONS}
        for page, doc_id, question in tqdm(questions, desc=name, unit="q"):
            history = histories[page]
            body = {
                "question": question,
                "document_ids": [doc_id],
                "top_k": args.top_k,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "history": history,
            }
            t0 = time.perf_counter()
            response = client.post("/v1/query", json=body)
            wall_ms = (time.perf_counter() - t0) * 1000
            if response.status_code != 200:
                raise RuntimeError(f"{name}: {response.status_code} {response.text}")
            out = response.json()
            rows.append(
                {
                    "page": page,
                    "turn": len(history) + 1,
                    "question": question,
                    "chunk_ids": out["chunk_ids"],
                    "num_citations": len(out["citations"]),
                    "dropped_turns": out["dropped_turns"],
                    "wall_ms": wall_ms,
                    **out["usage"],
                    **out["timings"],
                }
            )
            turn = {"question": question, "answer": out["answer"], "chunk_ids": out["chunk_ids"]}
            history.append(turn)
        return rows
    finally:
        client.__exit__(None, None, None)


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    ttft = [r["ttft_ms"] for r in rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {
        "ttft_mean_ms": float(np.mean(ttft)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p95_ms": float(np.percentile(ttft, 95)),
        "total_s": sum(r["wall_ms"] for r in rows) / 1000,
        "request_mean_ms": float(np.mean([r["total_ms"] for r in rows])),
        "cached_share": sum(r["cached_tokens"] for r in rows) / prompt,
        "prompt_tokens_mean": prompt / len(rows),
        "retrieval_mean_ms": float(np.mean([r["embed_ms"] + r["search_ms"] for r in rows])),
        "rerank_mean_ms": float(np.mean([r["rerank_ms"] for r in rows])),
        "dropped_turns": sum(r["dropped_turns"] for r in rows),
        "follow_ups_fully_reused": fully_reused(rows),
    }


def per_turn(rows: list[dict[str, Any]], key: str) -> list[float]:
    """Mean of `key` by turn number (1, 2, ...) across the conversations."""
    num_turns = max(r["turn"] for r in rows)
    return [
        float(np.mean([r[key] for r in rows if r["turn"] == t])) for t in range(1, num_turns + 1)
    ]


def fully_reused(rows: list[dict[str, Any]], block_size: int = 16) -> float:
    """Share of follow-ups whose cache hit covers everything the engine computed for the turn
    before (its prompt and all but the last generated token, in whole blocks): less means the
    answer text tokenized differently than generated, or blocks were evicted."""
    last: dict[str, dict[str, Any]] = {}
    hits = []
    for r in rows:
        before = last.get(r["page"])
        if before is not None:
            computed = before["prompt_tokens"] + before["completion_tokens"] - 1
            hits.append(r["cached_tokens"] >= computed // block_size * block_size)
        last[r["page"]] = r
    return float(np.mean(hits)) if hits else 0.0


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_len) = plt.subplots(1, 2, figsize=(14, 5), width_ratios=[2, 1])
    for name, rows in results.items():
        ax.plot(range(1, len(rows) + 1), [r["ttft_ms"] for r in rows], marker=".", label=name)
    ax.set_xlabel("question (4 conversations interleaved round by round)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("TTFT per question, prefix cache x chunk order")
    ax.legend()
    rows = results["cache_on_canonical"]
    turns = range(1, max(r["turn"] for r in rows) + 1)
    ax_len.plot(turns, per_turn(rows, "prompt_tokens"), marker="o", label="prompt tokens")
    ax_len.plot(turns, per_turn(rows, "cached_tokens"), marker="o", label="cached (cache on)")
    ax_len.set_xlabel("turn of the conversation")
    ax_len.set_ylabel("tokens (mean of 4 conversations)")
    ax_len.set_title("Prompt length per turn (canonical)")
    ax_len.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    # 4 conversations of up to ~5k tokens stay cached side by side (fp32 KV, ~46 KB a token)
    parser.add_argument("--kv-gb", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=10, help="questions per conversation")
    args = parser.parse_args()
    embedder = Embedder(packaged_embedder_path())
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rag-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        doc_ids = ingest(data_dir, embedder)
        if MODEL_CACHE.is_dir():  # reuse the tests' converted weights
            (data_dir / "cache").mkdir(parents=True, exist_ok=True)
            (data_dir / "cache" / "models").symlink_to(MODEL_CACHE.resolve())
        questions = interleaved(doc_ids, args.rounds)
        for name, cache_on, order in RUNS:
            settings = make_settings(data_dir, cache_on, args.kv_gb)
            results[name] = run_once(name, settings, order, embedder, questions, args)
    summary = {name: summarize(rows) for name, rows in results.items()}
    by_turn = {
        name: {
            "prompt_tokens": per_turn(rows, "prompt_tokens"),
            "ttft_ms": per_turn(rows, "ttft_ms"),
        }
        for name, rows in results.items()
    }
    on, off = summary["cache_on_canonical"], summary["cache_off_canonical"]
    goals = {
        "ttft_ratio_on_vs_off": on["ttft_mean_ms"] / off["ttft_mean_ms"],
        "ttft_goal_met": on["ttft_mean_ms"] <= off["ttft_mean_ms"] / 3,
        "cached_share_goal_met": on["cached_share"] >= 0.6,
    }
    RESULTS.mkdir(exist_ok=True)
    config = {**vars(args), "pages": list(CONVERSATIONS), "num_questions": len(questions)}
    payload = {
        "config": config,
        "summary": summary,
        "goals": goals,
        "per_turn": by_turn,
        "per_question": results,
    }
    (RESULTS / "rag_bench.json").write_text(json.dumps(payload, indent=2))
    plot(results, RESULTS / "rag_bench.png")
    print(
        f"\n{'run':<22}{'mean':>9}{'p50':>9}{'p95':>9}{'total s':>9}"
        f"{'cached':>8}{'retr':>7}{'rerank':>7}   (TTFT in ms)"
    )
    for name, s in summary.items():
        print(
            f"{name:<22}{s['ttft_mean_ms']:>9.1f}{s['ttft_p50_ms']:>9.1f}{s['ttft_p95_ms']:>9.1f}"
            f"{s['total_s']:>9.1f}{s['cached_share']:>8.0%}{s['retrieval_mean_ms']:>7.1f}"
            f"{s['rerank_mean_ms']:>7.1f}"
        )
    lengths = " ".join(f"{n:.0f}" for n in by_turn["cache_on_canonical"]["prompt_tokens"])
    print(f"prompt tokens per turn (mean of 4 conversations): {lengths}")
    print(
        f"follow-ups whose hit covers the whole previous turn (cache on, canonical): "
        f"{on['follow_ups_fully_reused']:.0%}; dropped turns: {on['dropped_turns']:.0f}"
    )
    print(
        f"TTFT cache on/off (canonical): {goals['ttft_ratio_on_vs_off']:.2f} (goal <= 0.33); "
        f"cached share {on['cached_share']:.0%} (goal >= 60%)"
    )


if __name__ == "__main__":
    main()
