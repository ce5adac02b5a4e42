"""The RAG workloads over Python docs pages, with and without chunk KV reuse, in one run.

    python -m bench.rag_bench          # everything: 19 minutes on 2 busy shared CPU cores
    python -m bench.rag_bench --quick  # a smoke run, small sets, 2 fractions: 5 minutes there
    python -m bench.rag_bench --rounds 10 --score-order   # the full follow-up workload of old

Every request goes through the real HTTP route (/v1/query, in-process client). Each
configuration gets its own app on its own copy of one ingested data dir; the configurations a
workload compares run side by side and are asked each question in turn, the order rotating from
one question to the next, so what else loads the machine hits them alike. Answers are greedy.

1. Follow-up workload (as before): each page gets one conversation of follow-up questions
   scoped to that page, every request sending the earlier turns back in `history`, so its
   prompt extends the previous turn's; conversations interleave round by round (A1 B1 C1 ...).
   Runs: cache_on_canonical (today: exact prefix cache, chunk reuse off),
   cache_on_canonical_reuse (chunk reuse on), cache_off_canonical (prefix cache off); with
   --score-order also cache_on_score and cache_off_score. Goals: cache on has mean TTFT <= 1/3
   of cache off and >= 60% of prompt tokens cached; chunk reuse is no worse than today (share of
   prompt tokens not prefilled no lower, mean TTFT <= 1.03x).
2. New-question workload: no history, round robin over the pages as users of a shared service
   would ask. Pass 1: independent questions. Pass 2: two-part questions, each joining two pass-1
   questions on the same page, so their sources were (the bench measures the share, from the
   citations) in pass-1 prompts, now in new combinations and positions. Configs: today (chunk
   reuse off), reuse (on, at --fraction, the Settings default unless given), off (prefix cache
   off, chunk reuse left on: the switch must turn every reuse off). Goals: pass 2 mean TTFT
   reuse <= 1/3 of today; pass 2 >= 70% of prompt tokens not prefilled ((cached + blended) /
   prompt); pass 1 mean TTFT reuse <= 1.03x today.
3. Fraction sweep and answer accuracy: one app per recompute fraction in --fractions, and one
   today, run pass 1 (one token each: it only fills the chunk store), pass 2 (TTFT, answers
   compared with today's and fraction 1.0's), then the accuracy questions: those of
   bench/data/python_docs_qa.json answered by --acc-pages, an answer being right when it holds one
   of the gold strings (case-insensitive). Blending needs stored chunks, and asking a question a
   second time would only hit the exact prefix cache, so the store is filled beforehand by a
   separate app at fraction 1.0 (exact KV) that asks every accuracy question with 2x top_k (its
   chunks land at other positions, next to other neighbours) and leaves their KV in the disk tier
   (data_dir/kv_chunks); every sweep app starts from a copy of it, so every fraction blends the
   same stored KV. Questions with an even index in the file tune the fraction (best tuning
   accuracy, then agreement with today, then the smaller fraction); those with an odd index are
   held out: the choice looks at the tuning half only, the held-out half is what to quote.
   The packaged 135M model seldom repeats a gold string verbatim (today: 1 of 43 questions
   over 11 pages at 32 tokens), so agreement with today's answers is the finer signal.

Writes bench/results/rag_bench.json (the follow-up keys as before, plus new_questions,
fraction_sweep, accuracy and reuse_goals), rag_bench.png (follow-up) and rag_bench_reuse.png
(TTFT per pass and config, the sweep, accuracy per fraction), and prints a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fastapi.testclient import TestClient
from tqdm import tqdm

from prefixrag.app.core.settings import Settings, packaged_embedder_path
from prefixrag.app.main import create_app
from prefixrag.app.prompt.builder import PromptBuilder, load_prompt_config
from prefixrag.app.state import LOADING
from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.html_text import html_to_text

HTML_ROOT = Path("/usr/share/doc/python3.11/html")
DOC_ROOT = HTML_ROOT / "library"
QA_PATH = Path(__file__).parent / "data" / "python_docs_qa.json"
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
# New-question workload, per page: pass-1 questions, and the pairs of them each pass-2 question
# joins ("X, and y?"). Pairs were picked so that the joined question retrieves (top 4) only
# chunks the two retrieved on their own; the bench measures how far that holds.
NEW_QUESTIONS: dict[str, tuple[list[str], list[tuple[int, int]]]] = {
    "json.html": (
        [
            "How do I write a Python object to a file as JSON?",
            "How do I decode a JSON document from a string?",
            "What does the indent argument of dump do?",
            "What does ensure_ascii control?",
        ],
        [(0, 1), (2, 3)],
    ),
    "csv.html": (
        [
            "Why should the file be opened with newline=''?",
            "How do I write dictionaries with DictWriter?",
            "What does writeheader do?",
            "How can I change the delimiter?",
        ],
        [(0, 1), (2, 3)],
    ),
    "functools.html": (
        [
            "How does lru_cache memoize a function?",
            "How do I see cache hits and misses?",
            "What does partial do?",
            "How do I write a single-dispatch generic function?",
        ],
        [(0, 1), (2, 3)],
    ),
    "shutil.html": (
        [
            "How do I copy a whole directory tree?",
            "How do I check free disk space?",
            "How do I move a file or directory?",
            "How do I find an executable on the PATH?",
        ],
        [(0, 1), (2, 3)],
    ),
}
# 13 questions (7 tuning, 6 held out), none on a new-question page
ACC_PAGES = (
    "tutorial/inputoutput.html,tutorial/errors.html,library/itertools.html,library/os.path.html"
)
RUNS = [  # the follow-up workload: (name, prefix cache, chunk reuse, chunk order)
    ("cache_on_canonical", True, False, "canonical"),
    ("cache_on_canonical_reuse", True, True, "canonical"),
    ("cache_off_canonical", False, True, "canonical"),
]
SCORE_RUNS = [("cache_on_score", True, False, "score"), ("cache_off_score", False, True, "score")]
RESULTS = Path(__file__).parent / "results"
MODEL = ""  # set by --model
MODEL_CACHE = Path(".pytest_cache/d/prefixrag-engine-models")
# the new-question and sweep apps hold ~20 prompts of ~750 tokens and their chunks (fp32 KV,
# ~46 KB a token); less than the follow-up's so that seven apps fit in memory side by side
NQ_KV_GB = 0.75
NO_WORSE = 1.03  # "no worse" in mean TTFT: within 3% (the pass-1 goal's margin)


# -- apps and data dirs ------------------------------------------------------------------------


def make_settings(
    data_dir: Path,
    prefix_cache: bool,
    kv_gb: float,
    *,
    chunk_reuse: bool = False,
    fraction: float | None = None,
) -> Settings:
    # None keeps the Settings default fraction; chunk reuse is off unless asked (today's engine)
    extra = {} if fraction is None else {"chunk_recompute_fraction": fraction}
    if MODEL:  # --model: every app serves this GGUF instead of the packaged 135M
        extra["llm"] = MODEL
    return Settings(
        data_dir=data_dir,
        embed_model=packaged_embedder_path(),
        rerank_model="",  # no pretrained cross-encoder here; first-stage order
        kv_cache_gb=kv_gb,
        prefix_cache=prefix_cache,
        chunk_reuse=chunk_reuse,
        index_use_gpu="no",
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        **extra,
    )


def started_client(settings: Settings, embedder: Embedder) -> TestClient:
    client = TestClient(create_app(settings, embedder=embedder))
    client.__enter__()
    if not client.app.state.prefixrag.wait_loaded(600):  # type: ignore[attr-defined]
        raise TimeoutError("the app did not finish loading")
    return client


@dataclass
class Config:
    """One way to run the engine: a name, its settings' switches and the chunk order."""

    name: str
    prefix_cache: bool = True
    chunk_reuse: bool = False
    fraction: float | None = None
    order: str = "canonical"
    kv_gb: float = NQ_KV_GB


class App:
    """One configuration's app on its own data dir; ask() posts a /v1/query and checks it."""

    def __init__(self, config: Config, data_dir: Path, embedder: Embedder) -> None:
        self.config = config
        self.name = config.name
        settings = make_settings(
            data_dir,
            config.prefix_cache,
            config.kv_gb,
            chunk_reuse=config.chunk_reuse,
            fraction=config.fraction,
        )
        # entered now, waited for in warm_up(): apps of a group load side by side, but for the
        # database migration, whose runner (alembic) keeps module globals: one at a time
        self.client = TestClient(create_app(settings, embedder=embedder))
        self.client.__enter__()
        state = self.client.app.state.prefixrag  # type: ignore[attr-defined]
        while state.status("db") == LOADING:
            time.sleep(0.05)

    def warm_up(self) -> None:
        state = self.client.app.state.prefixrag  # type: ignore[attr-defined]
        if not state.wait_loaded(600):
            raise TimeoutError(f"{self.name}: the app did not finish loading")
        if self.config.order == "score":
            state.prompts = PromptBuilder(
                state.llm.engine.tokenizer, load_prompt_config(), order="score"
            )
        # Warm-up (first torch calls) on a question with no sources: shares only the stable part.
        self.client.post(
            "/v1/query", json={"question": "warm up", "collection": "none", "max_tokens": 2}
        )

    def ask(self, body: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        response = self.client.post("/v1/query", json=body)
        wall_ms = (time.perf_counter() - t0) * 1000
        if response.status_code != 200:
            raise RuntimeError(f"{self.name}: {response.status_code} {response.text}")
        return {**response.json(), "wall_ms": wall_ms}

    def engine_stats(self) -> dict[str, int]:
        return self.client.app.state.prefixrag.llm.engine.stats()  # type: ignore[attr-defined]

    def close(self) -> None:
        self.client.__exit__(None, None, None)


def copy_data_dir(base: Path, dest: Path) -> Path:
    """A private copy of an ingested data dir: files copied, chunk KV files hard-linked (the disk
    tier writes each once and replaces it only by rename, so copies never see each other's
    writes), the model-cache symlink kept."""

    def copy(src: str, dst: str) -> None:
        if src.endswith(".kv"):
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(base, dest, symlinks=True, copy_function=copy)
    return dest


class Group:
    """Apps that run side by side; `start` gives each a fresh copy of one data dir."""

    def __init__(self, apps: list[App]) -> None:
        self.apps = apps
        self.stats: dict[str, dict[str, int]] = {}

    @classmethod
    def start(cls, configs: list[Config], base: Path, workdir: Path, embedder: Embedder) -> Group:
        group = cls([])
        try:
            for config in configs:
                data_dir = copy_data_dir(base, workdir / config.name)
                group.apps.append(App(config, data_dir, embedder))
            for app in group.apps:
                app.warm_up()
        except BaseException:
            group.close()
            raise
        return group

    def close(self) -> None:
        """Close every app, keeping its engine's counters in `stats`."""
        for app in self.apps:
            with contextlib.suppress(Exception):  # an app that never loaded has no engine
                self.stats[app.name] = app.engine_stats()
            app.close()
        self.apps = []

    def ask_round_robin(
        self,
        items: list[Any],
        body: Callable[[App, Any], dict[str, Any]],
        record: Callable[[App, Any, dict[str, Any]], None],
        desc: str,
    ) -> None:
        """Each item to every app; which app goes first rotates from one item to the next."""
        for i, item in enumerate(tqdm(items, desc=desc, unit="q")):
            k = i % len(self.apps)
            for app in self.apps[k:] + self.apps[:k]:
                record(app, item, app.ask(body(app, item)))


def ingest(data_dir: Path, embedder: Embedder, files: dict[str, Path]) -> dict[str, int]:
    """Upload `files` (key -> HTML path) into a fresh data dir; the document id of each key."""
    client = started_client(
        make_settings(data_dir, True, 0.1).model_copy(update={"load_llm": False}), embedder
    )
    try:
        ids = {}
        for key, path in files.items():
            upload = {"file": (path.name, path.read_bytes(), "text/html")}
            response = client.post("/v1/documents?wait=true", files=upload)
            if response.status_code != 201 or response.json()["status"] != "ready":
                raise RuntimeError(f"ingest of {key} failed: {response.text}")
            ids[key] = response.json()["id"]
            print(f"ingested {key}: {response.json()['num_chunks']} chunks")
        return ids
    finally:
        client.__exit__(None, None, None)


def link_model_cache(data_dir: Path, shared: Path) -> None:
    # every app's data dir points at one folder of converted weights, so none converts again
    (data_dir / "cache").mkdir(parents=True, exist_ok=True)
    (data_dir / "cache" / "models").symlink_to(shared.resolve())


# -- workload 1: follow-up conversations ---------------------------------------------------------


def interleaved(doc_ids: dict[str, int], num_rounds: int) -> list[tuple[str, int, str]]:
    """(page, document id, question), round by round across the conversations of the pages in
    `doc_ids`."""
    names = [n for n in CONVERSATIONS if n in doc_ids]
    rounds = list(zip(*(CONVERSATIONS[n] for n in names), strict=True))[:num_rounds]
    return [
        (n, doc_ids[n], q) for questions in rounds for n, q in zip(names, questions, strict=True)
    ]


def run_follow_up(
    base: Path, workdir: Path, embedder: Embedder, questions: list, args: Any
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, int]]]:
    runs = RUNS + (SCORE_RUNS if args.score_order else [])
    configs = [Config(n, cache, reuse, None, order, args.kv_gb) for n, cache, reuse, order in runs]
    pages = sorted({page for page, _, _ in questions})
    histories = {c.name: {page: [] for page in pages} for c in configs}
    rows: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}

    def body(app: App, item: tuple[str, int, str]) -> dict[str, Any]:
        page, doc_id, question = item
        return {
            "question": question,
            "document_ids": [doc_id],
            "top_k": args.top_k,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "history": histories[app.name][page],
        }

    def record(app: App, item: tuple[str, int, str], out: dict[str, Any]) -> None:
        page, _, question = item
        history = histories[app.name][page]
        rows[app.name].append(
            {
                "page": page,
                "turn": len(history) + 1,
                "question": question,
                "chunk_ids": out["chunk_ids"],
                "num_citations": len(out["citations"]),
                "dropped_turns": out["dropped_turns"],
                "wall_ms": out["wall_ms"],
                "answer": out["answer"],
                **out["usage"],
                **out["timings"],
            }
        )
        turn = {"question": question, "answer": out["answer"], "chunk_ids": out["chunk_ids"]}
        history.append(turn)

    group = Group.start(configs, base, workdir / "follow_up", embedder)
    try:
        group.ask_round_robin(questions, body, record, "follow-up")
    finally:
        group.close()
    return rows, group.stats


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    ttft = [r["ttft_ms"] for r in rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    blended = sum(r.get("blended_tokens", 0) for r in rows)
    return {
        "ttft_mean_ms": float(np.mean(ttft)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p95_ms": float(np.percentile(ttft, 95)),
        "total_s": sum(r["wall_ms"] for r in rows) / 1000,
        "request_mean_ms": float(np.mean([r["total_ms"] for r in rows])),
        "cached_share": sum(r["cached_tokens"] for r in rows) / prompt,
        "not_prefilled_share": (sum(r["cached_tokens"] for r in rows) + blended) / prompt,
        "blended_tokens": blended,
        "recomputed_tokens": sum(r.get("recomputed_tokens", 0) for r in rows),
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


# -- workload 2: new questions -------------------------------------------------------------------


def join_questions(first: str, second: str) -> str:
    """Two questions as one: "How do I X, and what does Y do?"."""
    return f"{first.rstrip('?')}, and {second[0].lower()}{second[1:]}"


def new_question_passes(
    doc_ids: dict[str, int], per_page_p1: int, per_page_p2: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Pass-1 and pass-2 items, round robin across the pages (a1 b1 c1 a2 b2 ...)."""
    pages = [p for p in NEW_QUESTIONS if p in doc_ids]
    p1, p2 = [], []
    for r in range(per_page_p1):
        for page in pages:
            question = NEW_QUESTIONS[page][0][r]
            p1.append({"pass": 1, "page": page, "doc_id": doc_ids[page], "question": question})
    for r in range(per_page_p2):
        for page in pages:
            questions, pairs = NEW_QUESTIONS[page]
            i, j = pairs[r]
            if max(i, j) >= per_page_p1:
                raise ValueError(f"pass-2 question {r} of {page} joins questions pass 1 skips")
            p2.append(
                {
                    "pass": 2,
                    "page": page,
                    "doc_id": doc_ids[page],
                    "question": join_questions(questions[i], questions[j]),
                    "joins": [i, j],
                }
            )
    return p1, p2


def query_row(item: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    return {
        **{k: v for k, v in item.items() if k not in ("doc_id", "doc_ids")},
        "chunk_ids": [c["chunk_id"] for c in out["citations"]],
        "answer": out["answer"],
        "wall_ms": out["wall_ms"],
        **out["usage"],
        **out["timings"],
    }


def ask_passes(
    group: Group,
    passes: list[tuple[str, list[dict[str, Any]], int, int]],
    rows: dict[str, list[dict[str, Any]]],
) -> None:
    """For each (label, items, max_tokens, top_k), every item to every app of the group."""
    for label, items, max_tokens, top_k in passes:

        def body(_: App, item: dict[str, Any], m: int = max_tokens, k: int = top_k) -> dict:
            ids = item.get("doc_ids", [item.get("doc_id")])
            return {
                "question": item["question"],
                "document_ids": ids,
                "top_k": k,
                "max_tokens": m,
                "temperature": 0,
            }

        def record(app: App, item: dict[str, Any], out: dict[str, Any]) -> None:
            rows.setdefault(app.name, []).append(query_row(item, out))

        group.ask_round_robin(items, body, record, label)


def pass_summary(
    rows: list[dict[str, Any]], reference: list[dict[str, Any]] | None = None
) -> dict[str, float]:
    """TTFT and where the prompt tokens came from; with `reference` (today's rows for the same
    questions, in the same order), the share of answers identical to it."""
    ttft = [r["ttft_ms"] for r in rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    blended = sum(r["blended_tokens"] for r in rows)
    out = {
        "n": len(rows),
        "ttft_mean_ms": float(np.mean(ttft)),
        "ttft_p50_ms": float(np.median(ttft)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "blended_tokens": blended,
        "recomputed_tokens": sum(r["recomputed_tokens"] for r in rows),
        "not_prefilled_share": (cached + blended) / prompt,
    }
    if reference is not None:
        out["same_answer_as_today"] = agreement(rows, reference)
    return out


def agreement(rows: list[dict[str, Any]], reference: list[dict[str, Any]]) -> float:
    """Share of answers identical to `reference`'s for the same questions (greedy decoding, so
    the same text means the same tokens)."""
    if [r["question"] for r in rows] != [r["question"] for r in reference]:
        raise ValueError("agreement needs the same questions in the same order")
    return float(
        np.mean([a["answer"] == b["answer"] for a, b in zip(rows, reference, strict=True)])
    )


def seen_share(earlier: list[dict[str, Any]], later: list[dict[str, Any]]) -> float:
    """Share of the source chunks of `later` prompts that some `earlier` prompt had."""
    seen = {c for r in earlier for c in r["chunk_ids"]}
    chunks = [c for r in later for c in r["chunk_ids"]]
    return sum(c in seen for c in chunks) / len(chunks) if chunks else 0.0


def by_pass(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("pass") == n]


# -- workload 3: the fraction sweep and answer accuracy ------------------------------------------


def accuracy_questions(pages: list[str]) -> list[dict[str, Any]]:
    """The QA file's questions whose gold string some of `pages` holds; even index: tuning half,
    odd: held out (a fixed rule, decided before any run)."""
    spec = json.loads(QA_PATH.read_text())
    texts = [html_to_text((HTML_ROOT / p).read_bytes(), definitions=True)[0] for p in pages]
    return [
        {
            "index": i,
            "half": "tuning" if i % 2 == 0 else "held_out",
            "question": q["q"],
            "answers": q["a"],
        }
        for i, q in enumerate(spec["questions"])
        if any(a in text for text in texts for a in q["a"])
    ]


def is_correct(answer: str, gold: list[str]) -> bool:
    return any(g.lower() in answer.lower() for g in gold)


def fill_chunk_store(
    base: Path, embedder: Embedder, items: list[dict[str, Any]], args: Any
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Ask every accuracy question once with a wider top_k at fraction 1.0 in an app on `base`
    itself, which keeps their chunks' KV in its disk tier for the sweep apps to start from."""
    config = Config("fill", chunk_reuse=True, fraction=1.0)
    group = Group([App(config, base, embedder)])
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        group.apps[0].warm_up()
        ask_passes(group, [("accuracy fill", items, 1, args.fill_top_k)], rows)
    finally:
        group.close()  # waits for the disk tier's writes
    stats = {**group.stats["fill"], "disk_files_after_close": len(list(base.rglob("*.kv")))}
    return rows["fill"], stats


def accuracy_summary(
    rows: list[dict[str, Any]], today: list[dict[str, Any]]
) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for half in ("tuning", "held_out"):
        part = [r for r in rows if r["half"] == half]
        ref = [r for r in today if r["half"] == half]
        out[half] = float(np.mean([r["correct"] for r in part])) if part else None
        out[f"{half}_same_as_today"] = agreement(part, ref) if part else None
    out["all"] = float(np.mean([r["correct"] for r in rows]))
    out["same_answer_as_today"] = agreement(rows, today)
    out.update({k: v for k, v in pass_summary(rows).items() if k != "n"})
    return out


def choose_fraction(modes: dict[str, dict[str, Any]]) -> float | None:
    """The fraction with the best tuning-half accuracy, then the best tuning-half agreement with
    today, then the smaller (faster) one. Never looks at the held-out half."""
    candidates = [m for m in modes.values() if m["fraction"] is not None]
    if not candidates or candidates[0]["tuning"] is None:
        return None
    best = max(
        candidates,
        key=lambda m: (m["tuning"], m["tuning_same_as_today"] or 0.0, -m["fraction"]),
    )
    return best["fraction"]


def fraction_name(fraction: float) -> str:
    return f"reuse@{fraction:g}"


# -- report ---------------------------------------------------------------------------------------


def goal(name: str, value: float, target: str, met: bool) -> dict[str, Any]:
    return {"goal": name, "value": value, "target": target, "met": bool(met)}


def plot_follow_up(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_len) = plt.subplots(1, 2, figsize=(14, 5), width_ratios=[2, 1])
    for name, rows in results.items():
        ax.plot(range(1, len(rows) + 1), [r["ttft_ms"] for r in rows], marker=".", label=name)
    ax.set_xlabel("question (conversations interleaved round by round)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("Follow-ups: TTFT per question, prefix cache x chunk reuse x chunk order")
    ax.legend()
    rows = results["cache_on_canonical"]
    turns = range(1, max(r["turn"] for r in rows) + 1)
    ax_len.plot(turns, per_turn(rows, "prompt_tokens"), marker="o", label="prompt tokens")
    ax_len.plot(turns, per_turn(rows, "cached_tokens"), marker="o", label="cached (today)")
    if "cache_on_canonical_reuse" in results:
        reuse = results["cache_on_canonical_reuse"]
        for r in reuse:
            r["not_prefilled"] = r["cached_tokens"] + r["blended_tokens"]
        ax_len.plot(turns, per_turn(reuse, "not_prefilled"), marker="x", label="cached+blended")
        for r in reuse:
            del r["not_prefilled"]
    ax_len.set_xlabel("turn of the conversation")
    ax_len.set_ylabel("tokens (mean over conversations)")
    ax_len.set_title("Prompt length per turn (canonical)")
    ax_len.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_reuse(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("new_questions", "fraction_sweep", "accuracy") if k in report]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "new_questions":
            summary = report["new_questions"]["summary"]
            names = list(summary)
            for p, offset in ((1, -0.2), (2, 0.2)):
                means = [summary[n][f"pass{p}"]["ttft_mean_ms"] for n in names]
                medians = [summary[n][f"pass{p}"]["ttft_p50_ms"] for n in names]
                x = np.arange(len(names)) + offset
                ax.bar(x, means, 0.38, label=f"pass {p} mean")
                ax.plot(x, medians, "k_", markersize=14, label="median" if p == 2 else None)
            ax.set_xticks(np.arange(len(names)), names)
            ax.set_ylabel("TTFT (ms)")
            ax.set_title("New questions: TTFT per pass and config")
            ax.legend()
        elif panel == "fraction_sweep":
            sweep = report["fraction_sweep"]
            points = sweep["fractions"]
            xs = [p["fraction"] for p in points]
            ax.plot(xs, [p["p2_ttft_mean_ms"] for p in points], "o-", label="pass-2 TTFT")
            ax.plot(xs, [p["p1_ttft_mean_ms"] for p in points], "s--", label="pass-1 TTFT")
            ax.axhline(sweep["today"]["p2_ttft_mean_ms"], color="grey", ls=":", label="today p2")
            ax.set_xlabel("chunk_recompute_fraction")
            ax.set_ylabel("mean TTFT (ms)")
            ax.set_title("Fraction sweep")
            twin = ax.twinx()
            agree = [100 * p["p2_same_as_today"] for p in points]
            twin.plot(xs, agree, "^-", color="tab:green", label="p2 answers = today (%)")
            twin.set_ylim(-5, 105)
            twin.set_ylabel("answers identical to today (%)")
            lines = ax.get_legend_handles_labels()
            more = twin.get_legend_handles_labels()
            ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8)
        else:
            acc = report["accuracy"]
            fractions = [m for m in acc["modes"].values() if m["fraction"] is not None]
            xs = [m["fraction"] for m in fractions]
            today = acc["modes"]["today"]
            for half, style in (("tuning", "o-"), ("held_out", "s-")):
                ax.plot(xs, [100 * (m[half] or 0) for m in fractions], style, label=half)
                ax.axhline(100 * (today[half] or 0), ls=":", color="grey")
            if acc["chosen_fraction"] is not None:
                ax.axvline(acc["chosen_fraction"], color="tab:red", ls="--", label="chosen")
            ax.set_xlabel("chunk_recompute_fraction (dotted: today)")
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(-3, 103)
            ax.set_title(f"Answer accuracy, {acc['num_questions']} questions")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_follow_up(summary: dict[str, dict[str, float]], goals: dict[str, Any]) -> None:
    print(
        f"\nFOLLOW-UPS\n{'run':<26}{'mean':>9}{'p50':>9}{'p95':>9}{'total s':>9}"
        f"{'cached':>8}{'+blend':>8}{'retr':>7}   (TTFT in ms)"
    )
    for name, s in summary.items():
        print(
            f"{name:<26}{s['ttft_mean_ms']:>9.1f}{s['ttft_p50_ms']:>9.1f}{s['ttft_p95_ms']:>9.1f}"
            f"{s['total_s']:>9.1f}{s['cached_share']:>8.0%}{s['not_prefilled_share']:>8.0%}"
            f"{s['retrieval_mean_ms']:>7.1f}"
        )
    on = summary["cache_on_canonical"]
    print(
        f"follow-ups whose hit covers the whole previous turn (today): "
        f"{on['follow_ups_fully_reused']:.0%}; dropped turns: {on['dropped_turns']:.0f}"
    )
    if "reuse_same_answer_as_today" in goals:
        same = goals["reuse_same_answer_as_today"]
        print(f"answers with chunk reuse identical to today's: {same:.0%}")
    if "ttft_ratio_on_vs_off" in goals:
        print(
            f"TTFT cache on/off (canonical): {goals['ttft_ratio_on_vs_off']:.2f} (goal <= 0.33); "
            f"cached share {on['cached_share']:.0%} (goal >= 60%)"
        )


def print_new_questions(nq: dict[str, Any]) -> None:
    print(
        f"\nNEW QUESTIONS (pass-2 source chunks seen in pass 1: {nq['p2_chunks_seen_in_p1']:.0%})"
        f"\n{'config':<8}{'pass':>5}{'n':>4}{'mean':>9}{'median':>9}{'not pf':>8}"
        f"{'cached':>8}{'blended':>8}{'recomp':>8}{'=today':>8}   (TTFT in ms)"
    )
    for name, passes in nq["summary"].items():
        for p in (1, 2):
            s = passes[f"pass{p}"]
            print(
                f"{name:<8}{p:>5}{s['n']:>4}{s['ttft_mean_ms']:>9.1f}{s['ttft_p50_ms']:>9.1f}"
                f"{s['not_prefilled_share']:>8.0%}{s['cached_tokens']:>8}{s['blended_tokens']:>8}"
                f"{s['recomputed_tokens']:>8}{s['same_answer_as_today']:>8.0%}"
            )


def print_sweep(sweep: dict[str, Any]) -> None:
    today = sweep["today"]
    print(
        f"\nFRACTION SWEEP (today: p1 {today['p1_ttft_mean_ms']:.0f} ms, "
        f"p2 {today['p2_ttft_mean_ms']:.0f} ms)\n{'fraction':>8}{'p1 mean':>9}{'p2 mean':>9}"
        f"{'p2 med':>8}{'p2 vs today':>12}{'p2 not pf':>10}{'p2=today':>9}{'p2=1.0':>8}"
    )
    for p in sweep["fractions"]:
        full = "-" if p["p2_same_as_full"] is None else f"{p['p2_same_as_full']:.0%}"
        print(
            f"{p['fraction']:>8g}{p['p1_ttft_mean_ms']:>9.0f}{p['p2_ttft_mean_ms']:>9.0f}"
            f"{p['p2_ttft_p50_ms']:>8.0f}{p['p2_ttft_vs_today']:>12.2f}"
            f"{p['p2_not_prefilled_share']:>10.0%}{p['p2_same_as_today']:>9.0%}{full:>8}"
        )


def print_accuracy(acc: dict[str, Any]) -> None:
    fill = acc["fill"]
    print(
        f"\nACCURACY ({acc['num_questions']} questions: {acc['num_tuning']} tuning (even index), "
        f"{acc['num_held_out']} held out (odd); {fill['eval_chunks_seen_in_fill']:.0%} of the "
        f"eval prompts' chunks were in the fill prompts)\n{'mode':<12}{'tuning':>8}{'held out':>9}"
        f"{'all':>6}{'=today':>8}{'not pf':>8}{'blended':>8}{'TTFT':>7}"
    )

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    for name, m in acc["modes"].items():
        print(
            f"{name:<12}{pct(m['tuning']):>8}{pct(m['held_out']):>9}{pct(m['all']):>6}"
            f"{pct(m['same_answer_as_today']):>8}{m['not_prefilled_share']:>8.0%}"
            f"{m['blended_tokens']:>8}{m['ttft_mean_ms']:>7.0f}"
        )
    chosen = acc["chosen_fraction"]
    if chosen is not None:
        m = acc["modes"][fraction_name(chosen)]
        print(
            f"chosen on the tuning half only: fraction {chosen:g}; held-out accuracy "
            f"{pct(m['held_out'])} vs today {pct(acc['modes']['today']['held_out'])}"
        )


def print_goals(goals: list[dict[str, Any]]) -> None:
    print("\nGOALS")
    for g in goals:
        verdict = "met" if g["met"] else "NOT met"
        print(f"  {g['goal']:<52} {g['value']:>7.3f}  ({g['target']})  {verdict}")


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    default_fraction = Settings.model_fields["chunk_recompute_fraction"].default
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16, help="follow-ups, new questions")
    parser.add_argument("--top-k", type=int, default=4)
    # 4 conversations of up to ~5k tokens stay cached side by side (fp32 KV, ~46 KB a token)
    parser.add_argument("--kv-gb", type=float, default=1.5, help="follow-up apps' KV pool")
    parser.add_argument("--rounds", type=int, default=3, help="questions per conversation (10)")
    parser.add_argument("--score-order", action="store_true", help="add score-ordered runs")
    parser.add_argument("--pages", type=int, default=4, help="pages of both workloads (1-4)")
    parser.add_argument("--p1-per-page", type=int, default=4, help="pass-1 questions a page")
    parser.add_argument("--p2-per-page", type=int, default=2, help="pass-2 questions a page")
    parser.add_argument("--fraction", type=float, default=default_fraction, help="reuse config")
    parser.add_argument("--fractions", default="0,0.05,0.15,0.3,0.5,1.0", help="the sweep")
    parser.add_argument("--acc-pages", default=ACC_PAGES, help="pages of the accuracy questions")
    parser.add_argument("--acc-max-tokens", type=int, default=24)
    parser.add_argument("--fill-top-k", type=int, default=0, help="0: 2 x top_k")
    parser.add_argument("--max-live", type=int, default=7, help="sweep apps side by side")
    parser.add_argument(
        "--parts", default="follow_up,new_questions,sweep", help="which workloads to run"
    )
    parser.add_argument("--quick", action="store_true", help="a ~5 minute smoke run")
    parser.add_argument("--model", default="", help="a GGUF every app serves (default: 135M)")
    parser.add_argument("--suffix", default="", help="results as rag_bench<suffix>.json/.png")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads of every app (0: torch's default)"
    )
    args = parser.parse_args()
    if args.quick:  # 2 pages, 2 questions of each kind a page, 2 fractions, 2 accuracy questions
        args.max_tokens, args.rounds, args.pages = 8, 2, 2
        args.p1_per_page, args.p2_per_page = 2, 1
        args.fractions, args.acc_pages, args.acc_max_tokens = "0,1.0", "tutorial/venv.html", 8
    args.fill_top_k = args.fill_top_k or 2 * args.top_k
    args.fractions = [float(f) for f in args.fractions.split(",")]
    args.parts = set(args.parts.split(","))
    if not 1 <= args.pages <= len(NEW_QUESTIONS):
        parser.error(f"--pages must be 1-{len(NEW_QUESTIONS)}")
    if args.parts - {"follow_up", "new_questions", "sweep"}:
        parser.error("--parts takes follow_up, new_questions, sweep")
    # one tenant, so equal bodies share store entries: a page in both sets would let the accuracy
    # fill feed the sweep's pass 1
    shared = {f"library/{p}" for p in NEW_QUESTIONS} & set(args.acc_pages.split(","))
    if shared:
        parser.error(f"--acc-pages must leave out the new-question pages: {sorted(shared)}")
    return args


def code_state() -> dict[str, Any]:
    """The commit and the uncommitted engine/app files the run measured (the engine is young)."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "engine", "app", "kernels", "retrieval")
    return {"commit": git("rev-parse", "HEAD"), "dirty": dirty.splitlines()}


def chunked(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def main() -> None:
    global MODEL
    args = parse_args()
    MODEL = args.model
    if args.threads:
        # before any app starts: every engine of the run shares this process's thread pool
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    code_at_start = code_state()  # apps import the engine as they start: note what it was
    embedder = Embedder(packaged_embedder_path())
    pages = list(NEW_QUESTIONS)[: args.pages]
    acc_pages = args.acc_pages.split(",") if "sweep" in args.parts else []
    acc_items = accuracy_questions(acc_pages) if acc_pages else []
    payload: dict[str, Any] = {}
    goals: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rag-bench-") as tmp:
        workdir = Path(tmp)
        base = workdir / "base"
        files = {p: DOC_ROOT / p for p in pages} | {p: HTML_ROOT / p for p in acc_pages}
        doc_ids = ingest(base, embedder, files)
        models = MODEL_CACHE if MODEL_CACHE.is_dir() else workdir / "models"
        models.mkdir(parents=True, exist_ok=True)  # the first app converts the weights here
        link_model_cache(base, models)
        page_ids = {p: doc_ids[p] for p in pages}
        acc_ids = [doc_ids[p] for p in acc_pages]
        for item in acc_items:
            item["doc_ids"] = acc_ids
        phases = {"ingest_s": time.perf_counter() - started}
        # follow-ups, then new questions (apps on copies of `base`), then the fill (on `base`
        # itself, which thereby gains the disk tier the sweep apps copy)
        if "follow_up" in args.parts:
            t0 = time.perf_counter()
            payload |= follow_up_report(base, workdir, embedder, page_ids, args, goals)
            phases["follow_up_s"] = time.perf_counter() - t0
        p1, p2 = new_question_passes(page_ids, args.p1_per_page, args.p2_per_page)
        if "new_questions" in args.parts:
            t0 = time.perf_counter()
            payload["new_questions"] = new_questions_report(
                base, workdir, embedder, p1, p2, args, goals
            )
            phases["new_questions_s"] = time.perf_counter() - t0
        if "sweep" in args.parts:
            t0 = time.perf_counter()
            payload |= sweep_report(base, workdir, embedder, p1, p2, acc_items, acc_pages, args)
            phases["sweep_and_accuracy_s"] = time.perf_counter() - t0
    config = {
        **{k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
        "pages": pages,
        "code_at_start": code_at_start,
        "code_at_end": code_state(),
        "elapsed_s": time.perf_counter() - started,
        "phases": phases,
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "torch_threads": torch.get_num_threads(),
        "load_average_at_end": os.getloadavg(),
    }
    payload = {"config": config, **payload, "reuse_goals": goals}
    RESULTS.mkdir(exist_ok=True)
    stem = f"rag_bench{args.suffix}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    if "per_question" in payload:
        plot_follow_up(payload["per_question"], RESULTS / f"{stem}.png")
    if "new_questions" in payload or "fraction_sweep" in payload:
        plot_reuse(payload, RESULTS / f"{stem}_reuse.png")
    if "summary" in payload:
        print_follow_up(payload["summary"], payload["goals"])
    if "new_questions" in payload:
        print_new_questions(payload["new_questions"])
    if "fraction_sweep" in payload:
        print_sweep(payload["fraction_sweep"])
        print_accuracy(payload["accuracy"])
    print_goals(goals)
    spent = ", ".join(f"{k.removesuffix('_s')} {v:.0f}s" for k, v in phases.items())
    print(f"\nelapsed {config['elapsed_s'] / 60:.1f} min ({spent}); results in {RESULTS}")


def follow_up_report(
    base: Path,
    workdir: Path,
    embedder: Embedder,
    page_ids: dict[str, int],
    args: Any,
    goals: list[dict[str, Any]],
) -> dict[str, Any]:
    questions = interleaved(page_ids, args.rounds)
    results, stats = run_follow_up(base, workdir, embedder, questions, args)
    summary = {name: summarize(rows) for name, rows in results.items()}
    by_turn = {
        name: {
            "prompt_tokens": per_turn(rows, "prompt_tokens"),
            "ttft_ms": per_turn(rows, "ttft_ms"),
        }
        for name, rows in results.items()
    }
    on, off = summary["cache_on_canonical"], summary["cache_off_canonical"]
    reuse = summary["cache_on_canonical_reuse"]
    today = results["cache_on_canonical"]
    ttft_ratio = reuse["ttft_mean_ms"] / on["ttft_mean_ms"]
    follow_goals = {
        "ttft_ratio_on_vs_off": on["ttft_mean_ms"] / off["ttft_mean_ms"],
        "ttft_goal_met": on["ttft_mean_ms"] <= off["ttft_mean_ms"] / 3,
        "cached_share_goal_met": on["cached_share"] >= 0.6,
        "reuse_ttft_ratio_vs_today": ttft_ratio,
        "reuse_not_prefilled_minus_today_cached": reuse["not_prefilled_share"] - on["cached_share"],
        "reuse_same_answer_as_today": agreement(results["cache_on_canonical_reuse"], today),
    }
    goals.append(
        goal(
            "follow-ups: mean TTFT reuse / today", ttft_ratio, f"<= {NO_WORSE}", ttft_ratio <= 1.03
        )
    )
    share_gap = follow_goals["reuse_not_prefilled_minus_today_cached"]
    goals.append(
        goal("follow-ups: not-prefilled share reuse - today", share_gap, ">= 0", share_gap >= 0)
    )
    return {
        "summary": summary,
        "goals": follow_goals,
        "per_turn": by_turn,
        "per_question": results,
        "follow_up_engine_stats": stats,
    }


def new_questions_report(
    base: Path,
    workdir: Path,
    embedder: Embedder,
    p1: list[dict[str, Any]],
    p2: list[dict[str, Any]],
    args: Any,
    goals: list[dict[str, Any]],
) -> dict[str, Any]:
    configs = [
        Config("today"),
        Config("reuse", chunk_reuse=True, fraction=args.fraction),
        Config("off", prefix_cache=False, chunk_reuse=True),
    ]
    rows: dict[str, list[dict[str, Any]]] = {}
    group = Group.start(configs, base, workdir / "new_questions", embedder)
    try:
        passes = [
            ("pass 1", p1, args.max_tokens, args.top_k),
            ("pass 2", p2, args.max_tokens, args.top_k),
        ]
        ask_passes(group, passes, rows)
    finally:
        group.close()
    today = rows["today"]
    summary = {
        name: {f"pass{p}": pass_summary(by_pass(r, p), by_pass(today, p)) for p in (1, 2)}
        for name, r in rows.items()
    }
    seen = {name: seen_share(by_pass(r, 1), by_pass(r, 2)) for name, r in rows.items()}
    reuse, base_ = summary["reuse"], summary["today"]
    p2_ratio = reuse["pass2"]["ttft_mean_ms"] / base_["pass2"]["ttft_mean_ms"]
    p1_ratio = reuse["pass1"]["ttft_mean_ms"] / base_["pass1"]["ttft_mean_ms"]
    p2_share = reuse["pass2"]["not_prefilled_share"]
    goals.append(
        goal("new questions pass 2: mean TTFT reuse / today", p2_ratio, "<= 1/3", p2_ratio <= 1 / 3)
    )
    goals.append(
        goal(
            "new questions pass 2: prompt share not prefilled", p2_share, ">= 0.70", p2_share >= 0.7
        )
    )
    goals.append(
        goal(
            "new questions pass 1: mean TTFT reuse / today",
            p1_ratio,
            f"<= {NO_WORSE}",
            p1_ratio <= NO_WORSE,
        )
    )
    return {
        "questions": {"pass1": [r["question"] for r in p1], "pass2": [r["question"] for r in p2]},
        "fraction": args.fraction,
        "p2_chunks_seen_in_p1": seen["today"],
        "p2_chunks_seen_in_p1_by_config": seen,
        "summary": summary,
        "engine_stats": group.stats,
        "per_question": rows,
    }


def sweep_report(
    base: Path,
    workdir: Path,
    embedder: Embedder,
    p1: list[dict[str, Any]],
    p2: list[dict[str, Any]],
    acc_items: list[dict[str, Any]],
    acc_pages: list[str],
    args: Any,
) -> dict[str, Any]:
    fill_rows, fill_stats = fill_chunk_store(base, embedder, acc_items, args)
    configs = [Config("today")] + [
        Config(fraction_name(f), chunk_reuse=True, fraction=f) for f in args.fractions
    ]
    rows: dict[str, list[dict[str, Any]]] = {}
    stats: dict[str, dict[str, int]] = {}
    for i, part in enumerate(chunked(configs, args.max_live)):
        group = Group.start(part, base, workdir / f"sweep{i}", embedder)
        try:
            passes = [
                ("sweep pass 1", p1, 1, args.top_k),  # fills the chunk store; one token is enough
                ("sweep pass 2", p2, args.max_tokens, args.top_k),
                ("accuracy", acc_items, args.acc_max_tokens, args.top_k),
            ]
            ask_passes(group, passes, rows)
        finally:
            group.close()
            stats |= group.stats
    for name_rows in rows.values():
        for r in name_rows:
            if "answers" in r:
                r["correct"] = is_correct(r["answer"], r["answers"])
    today = rows["today"]
    full = rows.get(fraction_name(1.0))
    t1, t2 = pass_summary(by_pass(today, 1)), pass_summary(by_pass(today, 2))
    points = []
    for f in args.fractions:
        r = rows[fraction_name(f)]
        s1, s2 = pass_summary(by_pass(r, 1)), pass_summary(by_pass(r, 2), by_pass(today, 2))
        points.append(
            {
                "fraction": f,
                "p1_ttft_mean_ms": s1["ttft_mean_ms"],
                "p2_ttft_mean_ms": s2["ttft_mean_ms"],
                "p2_ttft_p50_ms": s2["ttft_p50_ms"],
                "p2_ttft_vs_today": s2["ttft_mean_ms"] / t2["ttft_mean_ms"],
                "p2_not_prefilled_share": s2["not_prefilled_share"],
                "p2_blended_tokens": s2["blended_tokens"],
                "p2_recomputed_tokens": s2["recomputed_tokens"],
                "p2_same_as_today": s2["same_answer_as_today"],
                "p2_same_as_full": agreement(by_pass(r, 2), by_pass(full, 2)) if full else None,
            }
        )
    acc_rows = {name: [x for x in r if "answers" in x] for name, r in rows.items()}
    modes = {
        name: {
            "fraction": next((c.fraction for c in configs if c.name == name), None),
            **accuracy_summary(r, acc_rows["today"]),
        }
        for name, r in acc_rows.items()
    }
    fill_chunks = {r["question"]: set(r["chunk_ids"]) for r in fill_rows}
    eval_chunks = [(r["question"], c) for r in acc_rows["today"] for c in r["chunk_ids"]]
    seen = sum(c in fill_chunks[q] for q, c in eval_chunks) / max(len(eval_chunks), 1)
    sweep = {
        "today": {
            "p1_ttft_mean_ms": t1["ttft_mean_ms"],
            "p2_ttft_mean_ms": t2["ttft_mean_ms"],
            "p2_ttft_p50_ms": t2["ttft_p50_ms"],
        },
        "fractions": points,
        "note": "pass 1 asked with max_tokens=1 (it fills the chunk store); pass 2 in full",
    }
    accuracy = {
        "pages": acc_pages,
        "num_questions": len(acc_items),
        "num_tuning": sum(q["half"] == "tuning" for q in acc_items),
        "num_held_out": sum(q["half"] == "held_out" for q in acc_items),
        "rule": "even index in python_docs_qa.json: tuning; odd: held out",
        "choice": "best tuning accuracy, then tuning agreement with today, then smaller fraction",
        "blending_setup": "store filled by a separate app at fraction 1.0 asking each question "
        f"with top_k={args.fill_top_k}, max_tokens=1; its disk tier is copied to every sweep app",
        "fill": {
            "eval_chunks_seen_in_fill": seen,
            "engine_stats": fill_stats,
            "rows": fill_rows,
        },
        "modes": modes,
        "chosen_fraction": choose_fraction(modes),
    }
    return {
        "fraction_sweep": sweep,
        "accuracy": accuracy,
        "sweep_engine_stats": stats,
        "sweep_per_question": rows,
    }


if __name__ == "__main__":
    main()
