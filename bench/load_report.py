"""Turning load-test samples into figures: per-kind counts, rates and latency percentiles, the
RSS leak check, a summary table and a PNG."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.load_requests import Sample

_NUM_EXAMPLES = 3


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, as numpy), None for no values."""
    return float(np.percentile(values, q)) if values else None


def status_class(sample: Sample) -> str:
    """Exactly one of 2xx, 4xx, 429, 5xx, other (1xx/3xx) or exception, per sample."""
    if sample.status is None:
        return "exception"
    if sample.status == 429:
        return "429"
    if 200 <= sample.status < 300:
        return "2xx"
    if 400 <= sample.status < 500:
        return "4xx"
    if sample.status >= 500:
        return "5xx"
    return "other"


def kind_stats(samples: Sequence[Sample], elapsed_s: float) -> dict[str, Any]:
    """Counts by status class, rps, and latency percentiles of the 2xx requests (seconds).

    `elapsed_s` is the run's duration plus the time to drain the requests still in flight at
    its end, so rps is what the server completed, not what the clients offered.

    n_2xx + n_4xx + n_429 + n_5xx + n_other + n_exception == count; n_stream_errors counts
    the 2xx streams that broke off or reported an error in-band (a subset of n_2xx).
    """
    classes = Counter(status_class(s) for s in samples)
    good = [s.latency_s for s in samples if status_class(s) == "2xx" and s.error is None]
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    failed = [s for s in samples if s.error is not None or status_class(s) != "2xx"]
    stats: dict[str, Any] = {
        "count": len(samples),
        "rps": len(samples) / elapsed_s if elapsed_s > 0 else 0.0,
        "num_ok": len(good),
        "p50_s": percentile(good, 50),
        "p95_s": percentile(good, 95),
        "p99_s": percentile(good, 99),
        "mean_s": float(np.mean(good)) if good else None,
        "num_streams": sum(s.is_stream for s in samples),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
    }
    for name in ("2xx", "4xx", "429", "5xx", "other", "exception"):
        stats[f"n_{name}"] = classes.get(name, 0)
    stats["n_stream_errors"] = sum(1 for s in samples if s.status and s.error)
    stats["status_counts"] = dict(Counter(str(s.status) for s in samples if s.status))
    stats["errors"] = dict(Counter(s.error for s in samples if s.error))
    stats["examples"] = [
        {"status": s.status, "error": s.error, "detail": s.detail} for s in failed[:_NUM_EXAMPLES]
    ]
    return stats


def by_kind(samples: Sequence[Sample], elapsed_s: float) -> dict[str, dict[str, Any]]:
    """`kind_stats` for each kind present, plus "all"."""
    kinds = sorted({s.kind for s in samples})
    out = {k: kind_stats([s for s in samples if s.kind == k], elapsed_s) for k in kinds}
    out["all"] = kind_stats(samples, elapsed_s)
    return out


def rss_summary(
    samples: Sequence[tuple[float, int, float]], end_mib: Sequence[float], tolerance_mib: float
) -> dict[str, Any]:
    """Peak RSS, RSS after each run, growth after the first run and whether it stayed flat."""
    growth = [m - end_mib[0] for m in end_mib[1:]] if end_mib else []
    return {
        "peak_mib": max((m for _, _, m in samples), default=None),
        "end_mib_per_run": list(end_mib),
        "growth_after_first_mib": growth,
        "tolerance_mib": tolerance_mib,
        "is_flat": all(g <= tolerance_mib for g in growth) if growth else None,
        "samples": [[round(t, 2), label, round(m, 1)] for t, label, m in samples],
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def summary_table(kinds: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table: one row per kind, latencies in ms."""
    head = (
        f"{'kind':<8}{'count':>7}{'rps':>7}{'p50':>8}{'p95':>8}{'p99':>8}{'ttft95':>8}"
        f"{'2xx':>6}{'4xx':>5}{'429':>5}{'5xx':>5}{'exc':>5}{'strm':>5}"
    )
    rows = [head, "-" * len(head)]
    for kind, st in kinds.items():
        rows.append(
            f"{kind:<8}{st['count']:>7}{st['rps']:>7.2f}{_ms(st['p50_s']):>8}"
            f"{_ms(st['p95_s']):>8}{_ms(st['p99_s']):>8}{_ms(st['ttft_p95_s']):>8}"
            f"{st['n_2xx']:>6}{st['n_4xx']:>5}{st['n_429']:>5}{st['n_5xx']:>5}"
            f"{st['n_exception']:>5}{st['n_stream_errors']:>5}"
        )
    return "\n".join(rows)


def print_summary(report: dict[str, Any]) -> None:
    """The per-kind table, RSS per run, the document accounting and the goals."""
    print(summary_table(report["kinds"]))
    rss = report["rss"]
    if rss["peak_mib"] is not None:
        ends = ", ".join(f"{m:.0f}" for m in rss["end_mib_per_run"])
        growth = ", ".join(f"{g:+.0f}" for g in rss["growth_after_first_mib"]) or "-"
        print(f"RSS peak {rss['peak_mib']:.0f} MiB; after each run {ends} MiB; growth {growth}")
    docs = report["documents"]
    print(
        f"uploads: {docs['num_accepted']} accepted, {docs['num_ready']} ready, "
        f"{docs['num_failed']} failed, {docs['num_lost']} lost, {docs['num_half']} half "
        f"(settled in {docs['settle_s']:.1f} s)"
    )
    print("goals: " + ", ".join(f"{k}={v}" for k, v in report["goals"].items()))


def plot(report: dict[str, Any], path: Path) -> None:
    """Latency percentiles per kind (all runs) beside RSS over time, coloured by run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    kinds = [k for k in report["kinds"] if k != "all"]
    x = np.arange(len(kinds))
    names = [("p50_s", "p50"), ("p95_s", "p95"), ("p99_s", "p99"), ("ttft_p95_s", "TTFT p95")]
    for i, (key, label) in enumerate(names):
        values = [(report["kinds"][k][key] or 0.0) * 1000 for k in kinds]
        left.bar(x + (i - 1.5) * 0.2, values, width=0.2, label=label)
    left.set_xticks(x, kinds)
    left.set_yscale("log")
    left.set_ylabel("latency (ms, log)")
    left.set_title("latency by kind (2xx requests, all runs)")
    left.legend()
    samples = report["rss"]["samples"]
    for label in sorted({s[1] for s in samples}):
        points = [(t, m) for t, lab, m in samples if lab == label]
        name = "between runs" if label < 0 else f"run {label + 1}"
        style = "." if label < 0 else "-"
        right.plot(*zip(*points, strict=True), style, label=name, markersize=3)
    right.set_xlabel("time (s)")
    right.set_ylabel("server RSS (MiB)")
    right.set_title("server RSS over back-to-back runs")
    if samples:
        right.legend()
    fig.suptitle(
        f"{report['config']['clients']} clients x {report['config']['duration_s']:.0f} s"
        f" x {report['config']['runs']} runs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
