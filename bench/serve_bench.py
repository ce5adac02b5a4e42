"""A GGUF served the way a user runs it: `prefixrag serve` with PREFIXRAG_LLM=<file>, on the
service's defaults, as a process of its own.

    python -m bench.serve_bench --model <gguf> [--runs 3] [--questions 30]

Start (`--runs` times, a fresh data dir each): seconds from launching the process to its first
/readyz 200, its peak RSS by then (VmHWM), and the bytes it wrote (/proc/<pid>/io write_bytes,
which counts the new database too) and the biggest file it left in the data dir: a weight copy
would show in both.

Serving: one more process, over a copy of answer_eval's ingested corpus (ingested once in this
process, with no LLM, and kept in bench/.cache), answers the first `--questions` of the held-out
half through POST /v1/query at temperature 0. Its peak RSS over start-up and every answer is
held against the real-models issue's bound, the file + the KV pool (as /readyz's memory plan
sizes it) + 512 MiB; also the bytes it wrote while serving, and the answers' accuracy and TTFT
as answer_eval scores them.

Writes bench/results/serve_bench<suffix>.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from bench.answer_eval import DATA, DOC_ROOT, eval_client, kept_corpus, score, summarize
from bench.eval_split import split
from bench.load_server import MIB, ServerProcess, wait_ready

RESULTS = Path(__file__).parent / "results"
READY_TIMEOUT_S = 600.0
ANSWER_TIMEOUT_S = 900.0
HEADROOM = 512 * MIB  # what the bound allows beyond the mapped file and the KV pool


def proc_field(pid: int, name: str, key: str) -> int:
    """One `key: value` line of /proc/<pid>/<name> (status values are in kB)."""
    for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
        field, _, value = line.partition(":")
        if field == key:
            return int(value.split()[0]) * (1024 if name == "status" else 1)
    raise KeyError(f"no {key} in /proc/{pid}/{name}")


def biggest_file(root: Path) -> tuple[str, int]:
    """The largest file under `root` (relative path, bytes); ("", 0) when there is none."""
    sizes = [(str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file()]
    return max(sizes, key=lambda item: item[1], default=("", 0))


def serve(data_dir: Path, log: Path, model: str) -> tuple[ServerProcess, dict[str, Any]]:
    """A started server on `model` once /readyz answers 200, and what its start measured."""
    server = ServerProcess(data_dir, log, {"PREFIXRAG_LLM": model})
    t0 = time.perf_counter()
    server.start()
    try:
        wait_ready(server.url, READY_TIMEOUT_S, {}, server)
        ready_s = time.perf_counter() - t0
        assert server.pid is not None
        ready = httpx.get(f"{server.url}/readyz", timeout=10.0).json()
        start = {
            "ready_s": ready_s,
            "peak_rss_mib": proc_field(server.pid, "status", "VmHWM") / MIB,
            "written_mib": proc_field(server.pid, "io", "write_bytes") / MIB,
            "memory_plan": ready.get("memory_plan", {}),
        }
    except BaseException:
        server.stop()
        raise
    return server, start


def fresh_start(tmp: Path, model: str, run: int) -> dict[str, Any]:
    data_dir = tmp / f"fresh{run}"
    server, start = serve(data_dir, tmp / f"fresh{run}.log", model)
    server.stop()
    name, size = biggest_file(data_dir)
    return {**start, "biggest_file": name, "biggest_file_mib": size / MIB}


def serving(tmp: Path, model: str, spec: dict, num_questions: int) -> dict[str, Any]:
    kept = kept_corpus(spec)
    if not kept.is_dir():  # ingest once, in this process, without an LLM
        with eval_client(spec, kept, load_llm=False):
            pass
    data_dir = tmp / "serving"
    shutil.copytree(kept, data_dir)
    questions = split(spec["questions"])["held_out"][:num_questions]
    server, start = serve(data_dir, tmp / "serving.log", model)
    assert server.pid is not None
    rows = []
    try:
        written0 = proc_field(server.pid, "io", "write_bytes")
        with httpx.Client(base_url=server.url, timeout=ANSWER_TIMEOUT_S) as client:
            for question in tqdm(questions, desc="questions"):
                reply = client.post("/v1/query", json={"question": question["q"], "temperature": 0})
                reply.raise_for_status()
                rows.append(score(question, reply.json()))
        peak = proc_field(server.pid, "status", "VmHWM")
        written = proc_field(server.pid, "io", "write_bytes") - written0
    finally:
        server.stop()
    plan = start["memory_plan"]
    bound = Path(model).stat().st_size + plan.get("kv_pool", 0) + HEADROOM
    return {
        "start": start,
        "peak_rss_mib": peak / MIB,
        "bound_mib": bound / MIB,
        "within_bound": peak <= bound,
        "written_while_serving_mib": written / MIB,
        "summary": summarize(rows),
        "rows": rows,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = json.loads(DATA.read_text())
    report: dict[str, Any] = {
        "model": args.model,
        "file_mib": Path(args.model).stat().st_size / MIB,
        "cpus": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as name:
        tmp = Path(name)
        starts = [fresh_start(tmp, args.model, i) for i in range(args.runs)]
        report["starts"] = starts
        report["ready_s_median"] = float(np.median([s["ready_s"] for s in starts]))
        if args.questions:
            report["serving"] = serving(tmp, args.model, spec, args.questions)
    report["load_average_1m"] = os.getloadavg()[0]
    return report


def print_summary(report: dict[str, Any]) -> None:
    print(f"\n{report['model']} ({report['file_mib']:,.0f} MiB)")
    for i, s in enumerate(report["starts"]):
        print(
            f"start {i}: ready {s['ready_s']:5.1f} s, peak RSS {s['peak_rss_mib']:,.0f} MiB, "
            f"wrote {s['written_mib']:.1f} MiB, biggest file {s['biggest_file_mib']:.2f} MiB"
            f" ({s['biggest_file'] or 'none'})"
        )
    print(f"ready, median: {report['ready_s_median']:.1f} s")
    serving = report.get("serving")
    if serving:
        s = serving["summary"]
        verdict = "within" if serving["within_bound"] else "OVER"
        print(
            f"serving {s['questions']} questions: peak RSS {serving['peak_rss_mib']:,.0f} MiB "
            f"(bound {serving['bound_mib']:,.0f}: {verdict}), "
            f"wrote {serving['written_while_serving_mib']:.1f} MiB; "
            f"answer {s['answer_accuracy']:.3f}, recall {s['source_recall']:.3f}, "
            f"TTFT p50 {s['ttft_ms_p50'] / 1000:.1f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the GGUF to serve")
    parser.add_argument("--runs", type=int, default=3, help="fresh-data-dir starts to time")
    parser.add_argument("--questions", type=int, default=30, help="held-out questions (0: none)")
    parser.add_argument("--suffix", default="", help="appended to the result file name")
    args = parser.parse_args()
    if args.questions and not DOC_ROOT.is_dir():
        raise SystemExit(f"{DOC_ROOT} is missing: install Debian's python3.11-doc")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"serve_bench{args.suffix}.json"
    out.write_text(json.dumps(report, indent=2))
    print_summary(report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
