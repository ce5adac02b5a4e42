"""Attention of an extend after a cached prefix on CPU: the C tile kernel against SDPA and the
per-row kernel, on the same paged float16 cache, interleaved, medians.

An extend is what a new question over cached documents runs: n new rows (the question) over a
prefix of p cached positions (the documents). Three ways to compute it, all reading one paged
cache (SmolLM2-135M's shape: 9 query heads over 3 kv heads of 64):
- ``sdpa``: what the torch backend does, and the C backend did before the tile kernel: gather
  the prefix's blocks, widen them to float32, then SDPA under a causal mask;
- ``tiles``: cpu_ops.paged_extend_attention, reading the cache in place (csrc/extend_tiles.h;
  on AMX hosts csrc/extend_amx.h: the JSON's ``amx`` says which);
- ``rows``: cpu_ops.paged_attention_rows, the decode kernel, one row at a time.

With ``--against REV``, ``tiles`` and ``rows`` also run as built from kernels/csrc at git
revision REV (``tiles@REV``, ``rows@REV``), interleaved with today's, each case's speed against
them the median of the repeats' own ratios: a kernel change measured in one process.

    python -m bench.extend_attention_bench   # bench/results/extend_attention_bench.json
    python -m bench.extend_attention_bench --against HEAD~1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.revision_build import built_at
from prefixrag.engine.attention.sdpa import ROW_GROUP, extend_sdpa
from prefixrag.kernels import cpu_ops

RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [
    (2048, 1),
    (2048, 2),
    (2048, 4),
    (2048, 8),
    (2048, 32),
    (2048, 128),
    (2048, 512),
    (272, 560),
    (512, 32),
]


class Case:
    """A paged cache holding one sequence of p + n positions, in shuffled blocks."""

    def __init__(self, prefix: int, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.prefix, self.n, total = prefix, n, prefix + n
        blocks = -(-total // BLOCK)
        shape = (blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=gen).half()
        self.v_cache = torch.randn(shape, generator=gen).half()
        order = torch.randperm(blocks + 1, generator=gen)[:blocks]
        self.table = order.int()[None]
        self.q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
        self.k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
        self.v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
        self.out = torch.empty_like(self.q)
        self.scale = HEAD_DIM**-0.5

    def sdpa(self) -> None:
        # the plan sdpa.extend_entry builds once a step (not timed: every layer shares it)
        if not hasattr(self, "_entry"):
            groups = []
            for lo in range(0, self.n, ROW_GROUP):
                hi = min(lo + ROW_GROUP, self.n)
                keys = self.prefix + hi
                q_pos = torch.arange(self.prefix + lo, self.prefix + hi)
                visible = torch.arange(keys) <= q_pos.unsqueeze(1)
                mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
                groups.append((lo, hi, keys, mask))
            self._entry = [(0, self.n, self.table[0].long(), groups)]
        extend_sdpa(
            self.q, self.k, self.v, self.k_cache, self.v_cache, self._entry, self.scale, self.out
        )

    def tiles(self) -> None:
        cpu_ops.paged_extend_attention(
            self.q, self.k_cache, self.v_cache, self.table, torch.tensor([0]),
            torch.tensor([self.prefix], dtype=torch.int32),
            torch.tensor([self.n], dtype=torch.int32), self.scale, self.out,
        )  # fmt: skip

    def rows(self) -> None:
        ids = torch.arange(self.n)
        lens = torch.arange(self.prefix + 1, self.prefix + self.n + 1, dtype=torch.int32)
        cpu_ops.paged_attention_rows(
            self.q, self.k_cache, self.v_cache, self.table, ids,
            torch.zeros(self.n, dtype=torch.int32), lens, self.scale, self.out,
        )  # fmt: skip


def library_at(rev: str):
    """cpu_ops as built from kernels/csrc at git revision ``rev`` of this checkout."""
    return built_at(rev, cpu_ops.build.__wrapped__)  # past build's cache: today's library


def run_with(lib, fn: Callable[[], None]) -> Callable[[], None]:
    """fn with cpu_ops calling into lib"""

    def call() -> None:
        saved = cpu_ops.build
        cpu_ops.build = lambda *flags: lib
        try:
            fn()
        finally:
            cpu_ops.build = saved

    return call


def measure(case: Case, repeats: int, against: tuple[str, object] | None) -> dict:
    ways = {"sdpa": case.sdpa, "tiles": case.tiles, "rows": case.rows}
    if against is not None:
        rev, lib = against
        ways[f"tiles@{rev}"] = run_with(lib, case.tiles)
        ways[f"rows@{rev}"] = run_with(lib, case.rows)
    outputs = {}
    for name, fn in ways.items():  # warm-up: libraries built, buffers allocated
        fn()
        outputs[name] = case.out.clone()
    for name in ways:  # the same attention (up to summation order), so no wrong kernel is timed
        torch.testing.assert_close(outputs[name], outputs["sdpa"], atol=1e-4, rtol=1e-4)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(repeats):
        names = list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]
        for name in names:  # interleaved, each going first in turn: drift hits every way alike
            start = time.perf_counter()
            ways[name]()
            times[name].append(1000 * (time.perf_counter() - start))
    cell = {"median_ms": {name: statistics.median(t) for name, t in times.items()}}
    if against is not None:
        rev = against[0]
        cell["over_rev"] = {
            kernel: statistics.median(
                a / b for a, b in zip(times[kernel], times[f"{kernel}@{rev}"], strict=True)
            )
            for kernel in ("tiles", "rows")
        }
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--against", metavar="REV", help="also time the kernels of revision REV")
    parser.add_argument("--out", type=Path, default=RESULTS / "extend_attention_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the C kernels share torch's OpenMP pool
    against = (args.against, library_at(args.against)) if args.against else None
    rows = []
    header = ["prefix", "new", "sdpa ms", "tiles ms", "rows ms", "sdpa/tiles"]
    if against:
        header += [f"tiles/@{args.against}", f"rows/@{args.against}"]
    print(" ".join(f"{h:>10}" for h in header))
    for prefix, n in CASES:
        cell = measure(Case(prefix, n), args.repeats, against)
        rows.append({"prefix": prefix, "new": n, **cell})
        ms = cell["median_ms"]
        line = (
            f"{prefix:>10} {n:>10} {ms['sdpa']:>10.3f} {ms['tiles']:>10.3f} {ms['rows']:>10.3f} "
            f"{ms['sdpa'] / ms['tiles']:>9.2f}x"
        )
        if against:
            line += f" {cell['over_rev']['tiles']:>10.3f} {cell['over_rev']['rows']:>10.3f}"
        print(line)
    result = {
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "kv_dtype": "float16",
        "amx": cpu_ops.extend_amx_ready(HEAD_DIM),
        "threads": args.threads,
        "repeats": args.repeats,
        "against": args.against,
        "cases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
