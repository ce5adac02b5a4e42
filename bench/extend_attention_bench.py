"""Attention of an extend after a cached prefix on CPU: the C tile kernel against SDPA and the
per-row kernel, on the same paged float16 cache, interleaved, medians.

An extend is what a new question over cached documents runs: n new rows (the question) over a
prefix of p cached positions (the documents). Three ways to compute it, all reading one paged
cache (SmolLM2-135M's shape: 9 query heads over 3 kv heads of 64):
- ``sdpa``: what the torch backend does, and the C backend did before the tile kernel: gather
  the prefix's blocks, widen them to float32, then SDPA under a causal mask;
- ``tiles``: cpu_ops.paged_extend_attention (csrc/extend_tiles.h), reading the cache in place;
- ``rows``: cpu_ops.paged_attention_rows, the decode kernel, one row at a time.

    python -m bench.extend_attention_bench   # bench/results/extend_attention_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

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


def measure(case: Case, repeats: int) -> dict:
    ways = {"sdpa": case.sdpa, "tiles": case.tiles, "rows": case.rows}
    for fn in ways.values():  # warm-up: libraries built, buffers allocated
        fn()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():  # interleaved: drift hits every way alike
            start = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS / "extend_attention_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the C kernels share torch's OpenMP pool
    rows = []
    header = ("prefix", "new", "sdpa ms", "tiles ms", "rows ms", "sdpa/tiles")
    print(" ".join(f"{h:>10}" for h in header))
    for prefix, n in CASES:
        ms = measure(Case(prefix, n), args.repeats)
        rows.append({"prefix": prefix, "new": n, "median_ms": ms})
        print(
            f"{prefix:>10} {n:>10} {ms['sdpa']:>10.3f} {ms['tiles']:>10.3f} {ms['rows']:>10.3f} "
            f"{ms['sdpa'] / ms['tiles']:>9.2f}x"
        )
    result = {
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "kv_dtype": "float16",
        "threads": args.threads,
        "repeats": args.repeats,
        "cases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
