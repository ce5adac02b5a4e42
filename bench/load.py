"""Load test of the whole service over HTTP: N concurrent clients for D seconds, R runs.

    python -m bench.load [--clients 32] [--duration 60] [--runs 3] [--kinds upload,search,...]

Starts `prefixrag serve` on a free loopback port with a fresh data dir (or targets `--url`),
seeds a few generated documents, then each client loops, picking a kind by weight: upload
(unique small documents, ?wait=false), search, streamed Q&A (/v1/query) or OpenAI chat (half
streamed). The server's RSS (its process tree) is sampled every 0.5 s. After the runs it waits
for ingestion to settle and accounts for every accepted upload. Writes bench/results/load.json
and load.png and prints a summary. Goals: zero 5xx, zero lost or half-ingested documents, RSS
flat after the first run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.load_corpus import Corpus
from bench.load_report import by_kind, plot, print_summary, rss_summary
from bench.load_requests import KINDS, LLM_KINDS, LOAD_COLLECTION, RequestMaker, Sample
from bench.load_server import RssSampler, ServerProcess, wait_ready
from bench.load_verify import verify_documents

RESULTS = Path(__file__).parent / "results"
DEFAULT_KINDS = "upload=1,search=3,query=2,chat=2"
RAG_MODEL = "prefixrag-rag"


def parse_kinds(spec: str) -> dict[str, float]:
    """'upload=1,search=3' or 'upload,search' (weight 1) -> {kind: weight}."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, weight = item.partition("=")
        if name not in KINDS:
            raise ValueError(f"unknown kind {name!r}; known: {', '.join(KINDS)}")
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"weight of {name!r} is not a number: {weight!r}") from None
        if weights[name] <= 0:
            raise ValueError(f"weight of {name!r} must be positive, got {weights[name]}")
    if not weights:
        raise ValueError("no kinds given")
    return weights


@dataclass(slots=True)
class LoadConfig:
    """One load test: what to send, how hard, for how long, and where to write the results."""

    clients: int = 32
    duration_s: float = 60.0
    runs: int = 1
    kinds: dict[str, float] = field(default_factory=lambda: parse_kinds(DEFAULT_KINDS))
    max_tokens: int = 24
    timeout_s: float = 120.0
    num_seed_docs: int = 6
    url: str | None = None
    api_key: str | None = None
    auth: bool = True  # a server this run starts gets a key, and every request sends it
    pid: int | None = None
    data_dir: Path | None = None
    out_dir: Path = RESULTS
    name: str = "load"
    seed: int = 0
    ready_timeout_s: float = 900.0
    settle_timeout_s: float = 300.0
    rss_interval_s: float = 0.5
    leak_tolerance_mib: float = 64.0

    def __post_init__(self) -> None:
        for name in ("clients", "runs", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("duration_s", "timeout_s", "ready_timeout_s", "rss_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_seed_docs < 0 or self.settle_timeout_s < 0 or self.leak_tolerance_mib < 0:
            raise ValueError("num_seed_docs, settle_timeout_s and leak_tolerance_mib must be >= 0")
        unknown = set(self.kinds) - set(KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {self.kinds}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def _client_loop(
    maker: RequestMaker, cfg: LoadConfig, rng: random.Random, t0: float, out: list[Sample]
) -> None:
    kinds, weights = list(cfg.kinds), list(cfg.kinds.values())
    while time.perf_counter() - t0 < cfg.duration_s:
        out.append(await maker.run(rng.choices(kinds, weights)[0], rng, t0))


async def run_once(maker: RequestMaker, cfg: LoadConfig, index: int) -> dict[str, Any]:
    """One run of all clients for cfg.duration_s; its samples and elapsed seconds."""
    samples: list[Sample] = []
    t0 = time.perf_counter()
    rngs = [random.Random(cfg.seed * 1_000_003 + index * 1009 + i) for i in range(cfg.clients)]
    await asyncio.gather(*(_client_loop(maker, cfg, rng, t0, samples) for rng in rngs))
    return {"index": index, "elapsed_s": time.perf_counter() - t0, "samples": samples}


async def _chat_model(client: httpx.AsyncClient) -> str | None:
    reply = await client.get("/v1/models")
    reply.raise_for_status()
    names = [m["id"] for m in reply.json()["data"] if m["id"] != RAG_MODEL]
    return names[0] if names else None


async def _seed(client: httpx.AsyncClient, corpus: Corpus, cfg: LoadConfig) -> list[int]:
    rng = random.Random(cfg.seed)
    ids = []
    for _ in range(cfg.num_seed_docs):
        doc = corpus.document(rng, num_sections=4)
        body = {"text": doc.text, "title": doc.title, "collection": LOAD_COLLECTION}
        reply = await client.post("/v1/documents", params={"wait": "true"}, json=body)
        if reply.status_code != 201:
            raise RuntimeError(f"seeding failed: {reply.status_code} {reply.text[:300]}")
        ids.append(int(reply.json()["id"]))
    return ids


async def drive(cfg: LoadConfig, url: str, pid: int | None) -> dict[str, Any]:
    """Seed, run cfg.runs back-to-back runs, verify the uploads; the raw results."""
    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients)
    async with httpx.AsyncClient(
        base_url=url, headers=cfg.headers, timeout=timeout, limits=limits
    ) as client:
        chat_model = await _chat_model(client)
        if chat_model is None and set(cfg.kinds) & LLM_KINDS:
            raise ValueError("the server has no LLM loaded; pass --kinds upload,search")
        corpus = Corpus()
        maker = RequestMaker(client, corpus, cfg.max_tokens, cfg.timeout_s, chat_model)
        seeded = await _seed(client, corpus, cfg)
        sampler = RssSampler(pid, cfg.rss_interval_s) if pid is not None else None
        sampling = asyncio.ensure_future(sampler.run()) if sampler else None
        runs, rss_end = [], []
        for index in range(cfg.runs):
            if sampler:
                sampler.label = index
            runs.append(await run_once(maker, cfg, index))
            if sampler:
                sampler.label = -1
                rss_end.append(sampler.sample())
        documents = await verify_documents(
            client, seeded + maker.accepted_ids, cfg.settle_timeout_s
        )
        if sampling:
            sampling.cancel()
    return {
        "chat_model": chat_model,
        "runs": runs,
        "rss_end": [m for m in rss_end if m is not None],
        "rss_samples": sampler.samples if sampler else [],
        "rss_peak_per_run": [sampler.peak_mib(i) for i in range(cfg.runs)] if sampler else [],
        "documents": documents,
    }


def build_report(cfg: LoadConfig, raw: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: config, per-run and overall per-kind stats, RSS, documents, goals."""
    all_samples = [s for run in raw["runs"] for s in run["samples"]]
    total_s = sum(run["elapsed_s"] for run in raw["runs"])
    runs = [
        {
            "index": r["index"],
            "elapsed_s": r["elapsed_s"],
            "kinds": by_kind(r["samples"], r["elapsed_s"]),
        }
        for r in raw["runs"]
    ]
    for run, peak in zip(runs, raw["rss_peak_per_run"], strict=False):
        run["rss_peak_mib"] = peak
    kinds = by_kind(all_samples, total_s)
    rss = rss_summary(raw["rss_samples"], raw["rss_end"], cfg.leak_tolerance_mib)
    docs = raw["documents"]
    config = {k: v for k, v in asdict(cfg).items() if k not in ("api_key", "out_dir", "data_dir")}
    return {
        "config": config | {"chat_model": raw["chat_model"]},
        "server": server,
        "kinds": kinds,
        "runs": runs,
        "rss": rss,
        "documents": docs,
        "goals": {
            "zero_5xx": kinds["all"]["n_5xx"] == 0,
            "zero_exceptions": kinds["all"]["n_exception"] == 0,
            "zero_lost_or_half": docs["num_lost"] == 0 and docs["num_half"] == 0,
            "rss_flat": rss["is_flat"],
        },
    }


def run_load(cfg: LoadConfig) -> dict[str, Any]:
    """Run the whole load test (starting a server unless cfg.url); writes JSON + PNG."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="prefixrag-load-") as tmp:
        server = None
        if cfg.url is None:
            server = ServerProcess(cfg.data_dir or Path(tmp) / "data", Path(tmp) / "server.log")
            if cfg.auth and cfg.api_key is None:
                cfg = replace(cfg, api_key=server.create_key("load"))
            server.start()
        url = cfg.url or server.url  # type: ignore[union-attr]
        pid = server.pid if server else cfg.pid
        report: dict[str, Any] | None = None
        try:
            t0 = time.perf_counter()
            components = wait_ready(url, cfg.ready_timeout_s, cfg.headers, server)
            info = {"url": url, "managed": server is not None, "pid": pid}
            info |= {"startup_s": time.perf_counter() - t0, "components": components}
            raw = asyncio.run(drive(cfg, url, pid))
            info["alive_after"] = server.is_alive() if server else None
            report = build_report(cfg, raw, info)
        finally:
            if server is not None:
                died = not server.is_alive()
                server.stop()
                if died or _has_server_errors(report):
                    shutil.copy(server.log_path, cfg.out_dir / f"{cfg.name}.server.log")
    (cfg.out_dir / f"{cfg.name}.json").write_text(json.dumps(report, indent=2, default=str))
    plot(report, cfg.out_dir / f"{cfg.name}.png")
    return report


def _has_server_errors(report: dict[str, Any] | None) -> bool:
    if report is None:
        return True
    return report["kinds"]["all"]["n_5xx"] > 0 or report["kinds"]["all"]["n_exception"] > 0


def build_parser() -> argparse.ArgumentParser:
    """The command line; every flag maps onto a LoadConfig field."""
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds per run")
    p.add_argument("--runs", type=int, default=1, help="back-to-back runs (3 for the leak check)")
    p.add_argument("--kinds", default=DEFAULT_KINDS, help=f"kind[=weight],... of {KINDS}")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--seed-docs", type=int, default=6)
    p.add_argument("--url", default=None, help="target a running server instead of starting one")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="the server this run starts stays open (default: it gets a key, sent by every client)",
    )
    p.add_argument("--pid", type=int, default=None, help="with --url: server pid for RSS")
    p.add_argument("--data-dir", type=Path, default=None, help="default: a fresh temp dir")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--name", default="load", help="result file stem")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle-timeout", type=float, default=300.0)
    p.add_argument("--leak-tolerance-mib", type=float, default=64.0)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print the summary; 2 on bad flags."""
    args = build_parser().parse_args(argv)
    try:
        cfg = LoadConfig(
            clients=args.clients,
            duration_s=args.duration,
            runs=args.runs,
            kinds=parse_kinds(args.kinds),
            max_tokens=args.max_tokens,
            timeout_s=args.timeout,
            num_seed_docs=args.seed_docs,
            url=args.url,
            api_key=args.api_key,
            auth=not args.no_auth,
            pid=args.pid,
            data_dir=args.data_dir,
            out_dir=args.out_dir,
            name=args.name,
            seed=args.seed,
            settle_timeout_s=args.settle_timeout,
            leak_tolerance_mib=args.leak_tolerance_mib,
        )
    except ValueError as exc:
        print(f"bench.load: {exc}")
        return 2
    print_summary(run_load(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
