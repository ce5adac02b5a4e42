"""bench/load.py: its arithmetic against independent references, and a short real run against
a server it starts itself (no LLM: uploads and searches only)."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest

from bench.load import LoadConfig, parse_kinds, run_load
from bench.load_report import kind_stats
from bench.load_requests import Sample, _sse_events

STATUS_CLASSES = ("n_2xx", "n_4xx", "n_429", "n_5xx", "n_other", "n_exception")


def test_parse_kinds_weights_and_bad_input() -> None:
    assert parse_kinds("upload=2, search") == {"upload": 2.0, "search": 1.0}
    for bad in ("", "upload=0", "upload=x", "delete"):
        with pytest.raises(ValueError):
            parse_kinds(bad)
    with pytest.raises(ValueError):
        LoadConfig(clients=0)


def test_kind_stats_percentiles_and_counts() -> None:
    latencies = [0.01 * (i + 1) ** 1.5 for i in range(40)]
    statuses = [200] * 30 + [202, 404, 429, 429, 500, 503, None, None, 200, 200]
    samples = [
        Sample("search", 0.0, lat, status, error=None if status else "ReadTimeout")
        for lat, status in zip(latencies, statuses, strict=True)
    ]
    samples[-1].error = "stream: ended without done"
    samples[-1].is_stream = True
    stats = kind_stats(samples, elapsed_s=4.0)
    ok = [s.latency_s for s in samples if s.status in (200, 202) and s.error is None]
    reference = statistics.quantiles(ok, n=100, method="inclusive")
    assert stats["p50_s"] == pytest.approx(reference[49])
    assert stats["p95_s"] == pytest.approx(reference[94])
    assert stats["p99_s"] == pytest.approx(reference[98])
    assert stats["rps"] == pytest.approx(40 / 4.0)
    got = {k: stats[k] for k in STATUS_CLASSES}
    assert got == {"n_2xx": 33, "n_4xx": 1, "n_429": 2, "n_5xx": 2, "n_other": 0, "n_exception": 2}
    assert stats["n_stream_errors"] == 1
    assert stats["errors"] == {"ReadTimeout": 2, "stream: ended without done": 1}


def test_sse_events_framing() -> None:
    lines = ["event: delta", 'data: {"text": "a"}', "", "data: [DONE]", "", ": comment", ""]

    async def feed():
        for line in lines:
            yield line

    async def collect() -> list[tuple[str, str]]:
        return [event async for event in _sse_events(feed())]

    assert asyncio.run(collect()) == [("delta", '{"text": "a"}'), ("message", "[DONE]")]


@pytest.mark.slow
def test_short_run_report_adds_up(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXRAG_LOAD_LLM", "0")
    cfg = LoadConfig(
        clients=4,
        duration_s=3.0,
        runs=2,
        kinds=parse_kinds("upload=1,search=2"),
        num_seed_docs=2,
        out_dir=tmp_path,
        settle_timeout_s=120.0,
    )
    report = run_load(cfg)
    assert json.loads((tmp_path / "load.json").read_text()) == json.loads(
        json.dumps(report, default=str)
    )
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    kinds = report["kinds"]
    assert set(kinds) == {"upload", "search", "all"}
    for stats in kinds.values():
        assert sum(stats[k] for k in STATUS_CLASSES) == stats["count"]
    assert kinds["all"]["count"] == kinds["upload"]["count"] + kinds["search"]["count"] > 0
    assert sum(run["kinds"]["all"]["count"] for run in report["runs"]) == kinds["all"]["count"]
    assert kinds["all"]["n_5xx"] == 0 and kinds["all"]["n_exception"] == 0
    accepted = sum(kinds["upload"]["status_counts"].get(c, 0) for c in ("201", "202"))
    docs = report["documents"]
    assert docs["num_accepted"] == accepted + cfg.num_seed_docs
    assert docs["num_lost"] == 0 and docs["num_half"] == 0
    assert docs["num_ready"] + docs["num_failed"] == docs["num_accepted"]
    rss = report["rss"]
    assert len(rss["end_mib_per_run"]) == 2 and len(rss["growth_after_first_mib"]) == 1
    assert rss["peak_mib"] >= max(rss["end_mib_per_run"]) > 100
    assert {label for _, label, _ in rss["samples"]} >= {0, 1}
