"""Answer accuracy end to end through POST /v1/query, on the held-out half of the eval set.

The questions of bench/data/python_docs_qa.json are split by bench/eval_split.py: settings are
chosen on the "tune" half (`--half tune`, with `--configs` naming what to try) and reported on
the "held_out" half, where every configuration runs side by side in one app, question by
question (interleaved), on the same ingested corpus (the Python 3.11 docs of the eval set).

Per configuration:
- answer accuracy: a gold string in the answer (case and whitespace folded);
- evidence accuracy: a gold string in the top evidence span of a cited source (the line a reader
  sees highlighted first in that source), and its ratio to source recall; and, stricter, in the
  one best-scoring span of all the sources ("best span");
- source recall at top_k: a gold string in some cited source's text;
- loops: the share of answers that repeat a run of LOOP_WORDS words;
- evidence_ms p50: what the evidence spans add to a question.

A configuration is request fields (CONFIGS), optionally with a prompt variant after "@"
(PROMPTS: other system prompt or few-shot files, e.g. `shipped@extractive`). The prompt is fixed
when an app starts, so each prompt variant gets an app of its own, one after the other, on a
copy of the same corpus; configurations that share a prompt are interleaved in their app.

    python -m bench.answer_eval [--half held_out] [--configs today@key0,shipped] [--limit N]

`--model PATH` serves another GGUF than the packaged SmolLM2-135M (a second column, e.g. the
Qwen2.5-Coder-0.5B of bench/setup_qwen.sh, with `--suffix _qwen`); the corpus is the same, as
chunks are cut by the embedder's tokens.

`--peer` adds llama.cpp (bench/setup_peers.sh's venv) on the same file, fed the very prompt ids
the app built for each answer, and says where the two differ whether the prompt or the engine
is to blame (bench/answer_peer.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from tqdm import tqdm

from bench.answer_peer import LastGeneration, peer_answer, peer_summary
from bench.engine_bench import NOT_INSTALLED, ROOT, LlamaCpp
from bench.eval_split import HALVES, split
from prefixrag.app.core.settings import Settings, packaged_embedder_path, packaged_llm_path
from prefixrag.app.main import create_app
from prefixrag.app.services.grounding import refuses
from prefixrag.retrieval.embedder import Embedder

DOC_ROOT = Path("/usr/share/doc/python3.11/html")
DATA = Path(__file__).parent / "data" / "python_docs_qa.json"
RESULTS = Path(__file__).parent / "results"
CACHE = Path(__file__).parent / ".cache"
LOOP_WORDS = 6  # an answer that says the same 6 words twice repeats itself

# Request fields per configuration. "today" (with @key0) is what /v1/query did before this
# round's answer work (no repeat ban, the generic 256-token budget, top 5, no key lines);
# "shipped" is what it does now, with no field set, so it follows the settings' defaults.
CONFIGS: dict[str, dict[str, Any]] = {
    "today": {"no_repeat_ngram_size": 0, "max_tokens": 256, "top_k": 5},
    "shipped": {},
    "ngram3": {"no_repeat_ngram_size": 3},
    "ngram4": {"no_repeat_ngram_size": 4},
    "ngram5": {"no_repeat_ngram_size": 5},
    "ngram6": {"no_repeat_ngram_size": 6},
    "ngram10": {"no_repeat_ngram_size": 10},
    "freq0.5": {"no_repeat_ngram_size": 0, "frequency_penalty": 0.5},
    "rep1.2": {"no_repeat_ngram_size": 0, "repetition_penalty": 1.2},
    "ngram4+tok128": {"no_repeat_ngram_size": 4, "max_tokens": 128},
    "ngram3+tok128": {"no_repeat_ngram_size": 3, "max_tokens": 128},
    "ngram4+top3": {"no_repeat_ngram_size": 4, "top_k": 3},
    "ngram4+top8": {"no_repeat_ngram_size": 4, "top_k": 8},
}


# Prompt variants: settings for the app (files under bench/prompts/). "" is the packaged prompt.
PROMPTS_DIR = Path(__file__).parent / "prompts"
PROMPTS: dict[str, dict[str, Any]] = {
    "": {},
    "no_examples": {"few_shot_file": PROMPTS_DIR / "no_examples.json"},
    "tech_examples": {"few_shot_file": PROMPTS_DIR / "tech_examples.json"},
    "quote_examples": {"few_shot_file": PROMPTS_DIR / "quote_examples.json"},
    "quote": {"system_prompt_file": PROMPTS_DIR / "quote_system.txt"},
    "quote+examples": {
        "system_prompt_file": PROMPTS_DIR / "quote_system.txt",
        "few_shot_file": PROMPTS_DIR / "quote_examples.json",
    },
    # the best evidence sentences repeated just before the question (Settings.answer_key_lines;
    # key0: none, as before they were on by default)
    "key0": {"answer_key_lines": 0},
    "key1": {"answer_key_lines": 1},
    "key2": {"answer_key_lines": 2},
}


def parse_config(name: str) -> tuple[str, str]:
    """ "fields@prompt" (or "fields") as (request-fields name, prompt variant name)."""
    fields, _, prompt = name.partition("@")
    if fields not in CONFIGS or prompt not in PROMPTS:
        raise SystemExit(
            f"unknown config {name!r}; request fields: {', '.join(CONFIGS)}; "
            f"prompts after @: {', '.join(p for p in PROMPTS if p)}"
        )
    return fields, prompt


def folded(text: str) -> str:
    return " ".join(text.lower().split())


def holds_gold(text: str, answers: list[str]) -> bool:
    text = folded(text)
    return any(folded(a) in text for a in answers)


def loops(answer: str, n: int = LOOP_WORDS) -> bool:
    """True when some run of `n` words occurs twice in the answer."""
    words = re.findall(r"\w+", answer.lower())
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return len(grams) != len(set(grams))


def score(question: dict, out: dict) -> dict[str, Any]:
    """One answer's measures."""
    answers = question["a"]
    cited = out["citations"]
    spans = [(span["score"], span["text"]) for c in cited for span in c["evidence"][:1]]
    best_span = max(spans)[1] if spans else ""
    return {
        "q": question["q"],
        "answer": out["answer"],
        "answer_ok": holds_gold(out["answer"], answers),
        "evidence_ok": any(holds_gold(text, answers) for _, text in spans),
        "best_span_ok": holds_gold(best_span, answers),
        "recall": any(holds_gold(c["text"], answers) for c in cited),
        "refusal": refuses(out["answer"]),
        "loops": loops(out["answer"]),
        "evidence_ms": out["timings"].get("evidence_ms", 0.0),
        "ttft_ms": out["timings"]["ttft_ms"],
        "completion_tokens": out["usage"]["completion_tokens"],
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    mean = lambda key: float(np.mean([r[key] for r in rows])) if rows else 0.0  # noqa: E731
    recall = mean("recall")
    return {
        "questions": len(rows),
        "answer_accuracy": mean("answer_ok"),
        "evidence_accuracy": mean("evidence_ok"),
        "best_span_accuracy": mean("best_span_ok"),
        "source_recall": recall,
        "evidence_over_recall": mean("evidence_ok") / recall if recall else 0.0,
        "loop_share": mean("loops"),
        # refusals where a cited source holds the gold answer: the model gave up on a fact
        # its prompt held
        "refusals_when_recalled": (
            float(np.mean([r.get("refusal", False) for r in rows if r["recall"]]))
            if any(r["recall"] for r in rows)
            else 0.0
        ),
        "evidence_ms_p50": float(np.median([r["evidence_ms"] for r in rows])) if rows else 0.0,
        "ttft_ms_p50": float(np.median([r["ttft_ms"] for r in rows])) if rows else 0.0,
        "completion_tokens_mean": mean("completion_tokens"),
    }


def ingest(client: TestClient, documents: list[str]) -> None:
    for name in tqdm(documents, desc="ingest"):
        path = DOC_ROOT / name
        upload = {"file": (path.name, path.read_bytes(), "text/html")}
        response = client.post("/v1/documents?wait=true", files=upload)
        if response.status_code != 201 or response.json()["status"] != "ready":
            raise RuntimeError(f"ingest of {name} failed: {response.text}")


def _keep(client: TestClient, data_dir: Path, kept: Path) -> None:
    """Copy the freshly ingested data dir (database and index, saved) to `kept`."""
    state = client.app.state.prefixrag  # type: ignore[attr-defined]
    state.index.save()
    tmp = kept.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(data_dir, tmp, ignore=shutil.ignore_patterns("kv_chunks"))
    os.replace(tmp, kept)


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = json.loads(DATA.read_text())
    questions = split(spec["questions"])[args.half][: args.limit or None]
    configs = args.configs.split(",")
    by_prompt: dict[str, list[str]] = {}
    for config in configs:
        by_prompt.setdefault(parse_config(config)[1], []).append(config)
    kept = kept_corpus(spec)
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    started = time.perf_counter()
    model = {"llm": args.model} if args.model else {}
    peer = start_peer(args) if args.peer else None
    try:
        for prompt, group in by_prompt.items():
            settings = {**PROMPTS[prompt], **model}
            _run_app(spec, kept, questions, group, settings, rows, args.half, peer)
    finally:
        if peer is not None:
            peer.close()
    return {
        "half": args.half,
        "model": Path(args.model).name if args.model else "packaged (SmolLM2-135M-Instruct)",
        "questions": len(questions),
        "split_sizes": {h: len(v) for h, v in split(spec["questions"]).items()},
        "torch_threads": _torch_threads(),
        "wall_s": round(time.perf_counter() - started, 1),
        # this process served every question (the app runs in it): its peak resident memory
        "peak_rss_mib": _peak_rss_mib(),
        "configs": {c: _described(c) for c in configs},
        "peer": None if peer is None else peer.info,
        "summary": {c: {**summarize(rows[c]), **peer_summary(rows[c])} for c in configs},
        "answers": rows,
    }


def _described(config: str) -> dict[str, Any]:
    fields, prompt = parse_config(config)
    files = {
        k: str(v.relative_to(PROMPTS_DIR.parent)) if isinstance(v, Path) else v
        for k, v in PROMPTS[prompt].items()
    }
    return {**CONFIGS[fields], **files}


def _run_app(
    spec: dict,
    kept: Path,
    questions: list[dict],
    configs: list[str],
    settings: dict[str, Any],
    rows: dict[str, list[dict[str, Any]]],
    half: str,
    peer: LlamaCpp | None = None,
) -> None:
    """Ask every question under each configuration, interleaved, in one app with these settings
    (a prompt variant's, the model); the peer, when given, answers each of the app's prompts
    right after it."""
    with eval_client(spec, kept, **settings) as client:
        llm = client.app.state.prefixrag.llm  # type: ignore[attr-defined]
        last = LastGeneration()
        if peer is not None:  # only the peer reads what the app fed its engine
            last.install(llm)
        for question in tqdm(questions, desc=f"{half} questions"):
            for config in configs:  # interleaved: every config meets the same cache state
                fields = CONFIGS[parse_config(config)[0]]
                body = {"question": question["q"], "temperature": 0, **fields}
                response = client.post("/v1/query", json=body)
                response.raise_for_status()
                row = score(question, response.json())
                if peer is not None:
                    row["peer"] = peer_answer(peer, llm.engine.tokenizer, last)
                    row["peer"]["answer_ok"] = holds_gold(row["peer"]["answer"], question["a"])
                    row["peer"]["refusal"] = refuses(row["peer"]["answer"])
                rows[config].append(row)


def start_peer(args: argparse.Namespace) -> LlamaCpp:
    """llama.cpp on the model the app serves, with this process's torch threads."""
    python = args.peers_venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"llama.cpp: {NOT_INSTALLED}")
    model = args.model or packaged_llm_path()
    return LlamaCpp(python, model, _torch_threads(), args.peer_ctx, "on")


@contextmanager
def eval_client(spec: dict, kept: Path, **overrides: Any) -> Iterator[TestClient]:
    """A client of an app (settings `overrides` on this bench's defaults) serving a copy of the
    kept corpus, ingested into `kept` the first time; the copy is deleted afterwards."""
    data_dir = Path(tempfile.mkdtemp(prefix="answer-eval-"))
    if kept.is_dir():
        shutil.copytree(kept, data_dir, dirs_exist_ok=True)
    settings = Settings(
        **{
            "data_dir": data_dir,
            "embed_model": packaged_embedder_path(),
            "rerank_model": "",  # no pretrained cross-encoder on this machine: embedder spans
            "index_use_gpu": "no",
            "kv_cache_gb": 1.0,
            "max_num_seqs": 4,
            "chunk_disk_gb": 0.0,  # no chunk KV from an earlier run: every run starts cold
            **overrides,
        }
    )
    try:
        with TestClient(create_app(settings, embedder=Embedder(settings.embed_model))) as client:
            if not client.app.state.prefixrag.wait_loaded(600):  # type: ignore[attr-defined]
                raise TimeoutError("the app did not finish loading")
            if not kept.is_dir():
                ingest(client, spec["documents"])
                _keep(client, data_dir, kept)
            yield client
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def kept_corpus(spec: dict) -> Path:
    """Where the ingested corpus of this eval set is kept between runs (bench/.cache), keyed by
    its documents."""
    corpus = hashlib.sha256("\n".join(spec["documents"]).encode()).hexdigest()[:16]
    return CACHE / f"answer-eval-{corpus}"


def _peak_rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def print_summary(report: dict[str, Any]) -> None:
    model = report.get("model", "packaged")
    print(f"\n{report['half']} half, {report['questions']} questions, {model}", end="")
    print(f", {report['wall_s']} s, peak RSS {report.get('peak_rss_mib') or 0:.0f} MiB")
    head = f"{'config':24} {'answer':>7} {'evid.':>7} {'best':>7} {'recall':>7} {'ev/rec':>7}"
    head += f" {'loops':>7} {'refuse':>7}"
    print(head + f" {'ev_ms':>7} {'ttft_ms':>8} {'tokens':>7}")
    for name, s in report["summary"].items():
        print(
            f"{name:24} {s['answer_accuracy']:7.3f} {s['evidence_accuracy']:7.3f} "
            f"{s['best_span_accuracy']:7.3f} {s['source_recall']:7.3f} "
            f"{s['evidence_over_recall']:7.3f} {s['loop_share']:7.3f} "
            f"{s.get('refusals_when_recalled', 0.0):7.3f} "
            f"{s['evidence_ms_p50']:7.1f} {s['ttft_ms_p50']:8.0f} "
            f"{s['completion_tokens_mean']:7.1f}"
        )
        if "peer_answer_accuracy" in s:
            print(
                f"{'  llama.cpp, same prompt':24} {s['peer_answer_accuracy']:7.3f}"
                f"  refusals {s['peer_refusals_when_recalled']:.3f}, same answer "
                f"{s['same_answer']:.3f}, first 16 tokens equal {s['first_tokens_equal']:.3f}; "
                f"where they differ: near tie {s['differ_near_tie']}, "
                f"engine {s['differ_engine']}, reuse {s['differ_reuse']}; both wrong alike "
                f"{s['both_wrong_same_answer']}; only ours right {s['only_ours_right']}, "
                f"only theirs {s['only_peer_right']}"
            )


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = ["answer_accuracy", "evidence_accuracy", "source_recall", "loop_share"]
    configs = list(report["summary"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        values = [report["summary"][config][m] for m in measures]
        ax.bar(np.arange(len(measures)) + i * width, values, width, label=config)
    labels = [m.replace("_", " ") for m in measures]
    ax.set_xticks(np.arange(len(measures)) + 0.4 - width / 2, labels)
    ax.set_ylim(0, 1)
    title = f"/v1/query on the {report['half']} half ({report['questions']} questions)"
    ax.set_title(f"{title}, {report.get('model', 'packaged model')}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--half", choices=HALVES, default="held_out")
    parser.add_argument(
        "--configs",
        default="today@key0,shipped",
        help=f"request fields ({', '.join(CONFIGS)}), each optionally @prompt "
        f"({', '.join(p for p in PROMPTS if p)})",
    )
    parser.add_argument("--limit", type=int, default=0, help="first N questions only (0: all)")
    parser.add_argument("--model", default="", help="a GGUF to serve (default: the packaged one)")
    parser.add_argument("--suffix", default="", help="appended to the result file names")
    parser.add_argument("--peer", action="store_true", help="llama.cpp on the same prompt ids")
    parser.add_argument("--peer-ctx", type=int, default=8192, help="the peer's context size")
    parser.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not DOC_ROOT.is_dir():
        raise SystemExit(f"{DOC_ROOT} is missing: install Debian's python3.11-doc")
    report = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"answer_eval_{args.half}{args.suffix}.json"
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    print_summary(report)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
