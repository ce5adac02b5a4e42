"""Prefill-sized matmuls over GGUF block weights: the block kernel's tiles against the GEMM.

A new question after cached documents prefills tens of tokens. Up to TILE_KERNEL_MAX_ROWS rows
(engine/quant.py) a block weight takes the block kernel, with its tiles where the build has them
(kernels/csrc/block_tiles.h, AVX-512); past it, oneDNN's GEMM over the dequantized matrix, packed
once at load (engine/packed_gemm.py), which every prefill of more than 16 rows took before.

- matmuls: the packaged model's layer matrices (the LM head left out: a prefill computes it for
  its last row only), for each row count the whole set through the GEMM, the tiles, the block
  kernel's row loop without tiles (a build with TILE_MIN_ROWS past every count: what 12 to 16
  rows took before the tiles) and, on hosts with AMX, its tile products (csrc/amx_matmul.h, which
  the engine takes past 16 rows up to AMX_MAX_ROWS), interleaved, the order rotating by repeat;
  medians, and the median of each repeat's own ratio to the GEMM;
- warm TTFT: one engine, a 2,048-token prefix cached, then a prompt of it and 32 new tokens, the
  32 rows through the GEMM, the tiles and (with AMX) AMX's products in turn, each prompt's 32
  tokens new.

With ``--against REV`` (hosts with AMX), the AMX products as built from the kernels of git
revision REV are timed beside today's in the same sweeps: a change to csrc/amx_matmul.h measured
in one process, ``amx_over_against`` being the median of each repeat's own ratio.

Writes JSON and a PNG, and prints a summary::

    python -m bench.prefill_matmul_bench [--threads 2] [--repeats 9] [--rows 16,32,...]
        [--against REV] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.engine_bench import (
    RESULTS,
    Ours,
    build_engine,
    corpus_ids,
    cpu_info,
    fresh_scope,
    pin_threads,
)
from bench.revision_build import built_at
from prefixrag.app.core.settings import get_settings, packaged_llm_path
from prefixrag.engine import quant
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.packed_gemm import pack_weight, packed_linear
from prefixrag.kernels import block_quant_matmul as bqm
from prefixrag.kernels.block_quant_matmul import (
    BlockQuantWeight,
    amx_ready,
    block_quant_dequantize,
    block_quant_matmul,
    block_quant_matmul_amx,
    tile_min_rows,
)
from prefixrag.kernels.native_build import DEFAULT_FLAGS

ROWS = (16, 32, 48, 64, 96, 128)
PREFIX, SUFFIX = 2048, 32
NO_TILES = (*DEFAULT_FLAGS, "-DTILE_MIN_ROWS=1000000")


def layer_weights(engine) -> list[tuple[BlockQuantWeight, object]]:
    """Each layer matrix, with the packed float32 matrix prefill's GEMM reads."""
    vocab = engine.runner.model.config.vocab_size
    return [
        (w, w.dense if w.dense is not None else pack_weight(block_quant_dequantize(w)))
        for w in quant._block_weights(engine.runner.model)
        if w.shape[0] != vocab
    ]


def sweep_ms(run, weights, xs) -> float:
    start = time.perf_counter()
    for (block, dense), x in zip(weights, xs, strict=True):
        run(x, block, dense)
    return 1000 * (time.perf_counter() - start)


def tiles(x, block, dense):
    return block_quant_matmul(x, block)


def row_loop(x, block, dense):
    return block_quant_matmul(x, block, NO_TILES)


def gemm(x, block, dense):
    return packed_linear(x, dense)


def amx(x, block, dense):
    return block_quant_matmul_amx(x, block)


KERNELS = {"gemm": gemm, "tiles": tiles, "rows": row_loop}
if amx_ready():
    KERNELS["amx"] = amx


def amx_at(rev: str):
    """The amx kernel with block_quant_matmul calling into the library built from
    kernels/csrc at git revision ``rev``."""
    lib = built_at(rev, lambda: bqm.load_library("block_quant_matmul.c"))

    def run(x, block, dense):
        saved = bqm.load_library
        bqm.load_library = lambda source, flags=DEFAULT_FLAGS: lib
        try:
            return block_quant_matmul_amx(x, block)
        finally:
            bqm.load_library = saved

    return run


def bench_matmuls(engine, repeats: int, row_counts: tuple[int, ...]) -> dict:
    weights = layer_weights(engine)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for rows in row_counts:
        xs = [torch.randn(rows, block.shape[1], generator=gen) for block, _ in weights]
        # the same products (up to summation order), so a timing is never of a wrong kernel
        for (block, dense), x in list(zip(weights, xs, strict=True))[:4]:
            want = gemm(x, block, dense)
            assert torch.equal(tiles(x, block, dense), row_loop(x, block, dense))
            for name in KERNELS:
                torch.testing.assert_close(
                    KERNELS[name](x, block, dense), want, atol=1e-4, rtol=1e-4
                )
        names = list(KERNELS)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for r in range(repeats + 1):  # the first repeat warms up, untimed
            for name in names[r % len(names) :] + names[: r % len(names)]:
                ms = sweep_ms(KERNELS[name], weights, xs)
                if r:
                    samples[name].append(ms)
        cell: dict[str, object] = {"samples_ms": samples}
        for name in names:
            cell[f"{name}_ms"] = statistics.median(samples[name])
        for name in names[1:]:
            ratios = [a / g for a, g in zip(samples[name], samples["gemm"], strict=True)]
            cell[f"{name}_over_gemm"] = statistics.median(ratios)
            cell[f"{name}_ratio_range"] = [min(ratios), max(ratios)]
        against = [name for name in names if name.startswith("amx@")]
        if against:
            ratios = [a / b for a, b in zip(samples["amx"], samples[against[0]], strict=True)]
            cell["amx_over_against"] = statistics.median(ratios)
            cell["amx_over_against_range"] = [min(ratios), max(ratios)]
        out[str(rows)] = cell
    return {"matrices": len(weights), "rows": out}


def warm_settings() -> dict[str, tuple[int, int]]:
    """Each way of running a warm prompt's 32 rows: (TILE_KERNEL_MAX_ROWS, AMX_MAX_ROWS)"""
    block, tiles = quant.BLOCK_KERNEL_MAX_ROWS, quant.TILE_KERNEL_MAX_ROWS
    ways = {"gemm": (block, block), "tiles": (tiles, block)}
    if amx_ready():
        ways["amx"] = (tiles, max(quant.AMX_MAX_ROWS, SUFFIX))
    return ways


def bench_warm(engine, repeats: int) -> dict:
    ours = Ours(engine)
    prefix = corpus_ids(engine, PREFIX)
    settings = warm_settings()
    suffixes = [
        corpus_ids(engine, SUFFIX, PREFIX + SUFFIX * i)
        for i in range(len(settings) * (repeats + 1) + 1)
    ]
    ours.scope = fresh_scope()
    ours.run_one(prefix + suffixes[0], 1, ours.scope)  # the prefix, cached
    samples: dict[str, list[float]] = {name: [] for name in settings}
    saved, used = (quant.TILE_KERNEL_MAX_ROWS, quant.AMX_MAX_ROWS), 1
    names = list(settings)
    try:
        for r in range(repeats + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                quant.TILE_KERNEL_MAX_ROWS, quant.AMX_MAX_ROWS = settings[name]
                result = ours.run_one(prefix + suffixes[used], 1, ours.scope)
                used += 1
                if result.cached_tokens < PREFIX - engine.runner.block_size:
                    raise RuntimeError(f"the prefix was not reused: {result.cached_tokens}")
                if r:
                    samples[name].append(1000 * result.ttft_s)
    finally:
        quant.TILE_KERNEL_MAX_ROWS, quant.AMX_MAX_ROWS = saved
    out: dict[str, object] = {"prefix_tokens": PREFIX, "new_tokens": SUFFIX, "samples_ms": samples}
    for name in names:
        out[f"{name}_ms"] = statistics.median(samples[name])
        if name != "gemm":
            ratios = [t / g for t, g in zip(samples[name], samples["gemm"], strict=True)]
            out[f"{name}_over_gemm"] = statistics.median(ratios)
            out[f"{name}_ratio_range"] = [min(ratios), max(ratios)]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [int(r) for r in result["matmuls"]["rows"]]
    cells = result["matmuls"]["rows"].values()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rows, [c["gemm_ms"] for c in cells], "o-", label="GEMM over the dequantized matrix")
    ax.plot(rows, [c["tiles_ms"] for c in cells], "o-", label="block kernel, tiles")
    ax.plot(rows, [c["rows_ms"] for c in cells], "o--", label="block kernel, row loop")
    if all("amx_ms" in c for c in cells):
        ax.plot(rows, [c["amx_ms"] for c in cells], "o-", label="AMX, operands in 3 parts")
    ax.axvline(quant.TILE_KERNEL_MAX_ROWS, color="grey", ls=":", label="TILE_KERNEL_MAX_ROWS")
    ax.set_xlabel("rows of x (new prompt tokens)")
    ax.set_ylabel(f"ms for the model's {result['matmuls']['matrices']} layer matrices")
    ax.set_title(f"prefill matmuls, {result['threads']} threads (medians)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--rows", default=",".join(map(str, ROWS)), help="comma-separated rows of x to time"
    )
    parser.add_argument(
        "--against", metavar="REV", help="also time the AMX kernel of git revision REV"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill_matmul_bench.json")
    args = parser.parse_args()
    pin_threads(args.threads)
    if not tile_min_rows():
        print("this build has no block tiles (they need AVX-512): nothing to compare")
        sys.exit(0)
    if args.against:
        if "amx" not in KERNELS:
            sys.exit("--against times the AMX kernel, and this host or build has no AMX")
        KERNELS[f"amx@{args.against}"] = amx_at(args.against)
    settings = get_settings()
    config = EngineConfig(
        model=str(packaged_llm_path()),
        cache_dir=str(settings.cache_dir / "models"),
        kv_cache_gb=0.5,
        max_num_batched_tokens=4096,
    )
    engine = build_engine(config, "gguf", "auto")
    result = {
        "model": config.model,
        "cpu": cpu_info(),
        "threads": args.threads,
        "tile_kernel_max_rows": quant.TILE_KERNEL_MAX_ROWS,
        "amx_max_rows": quant.AMX_MAX_ROWS if amx_ready() else None,
        "against": args.against,
        "matmuls": bench_matmuls(engine, args.repeats, tuple(int(r) for r in args.rows.split(","))),
        "warm_ttft": bench_warm(engine, args.repeats),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    names = list(KERNELS)
    print(f"{'rows':>5} " + " ".join(f"{n + ' ms':>9}" for n in names) + "   over GEMM (range)")
    for rows, cell in result["matmuls"]["rows"].items():
        ratios = "  ".join(
            f"{n} {cell[n + '_over_gemm']:.3f} ({cell[n + '_ratio_range'][0]:.3f}-"
            f"{cell[n + '_ratio_range'][1]:.3f})"
            for n in names[1:]
        )
        print(f"{rows:>5} " + " ".join(f"{cell[n + '_ms']:9.1f}" for n in names) + f"   {ratios}")
        if "amx_over_against" in cell:
            low, high = cell["amx_over_against_range"]
            print(f"      amx over amx@{args.against}: {cell['amx_over_against']:.3f} "
                  f"({low:.3f}-{high:.3f})")  # fmt: skip
    warm = result["warm_ttft"]
    ways = ", ".join(f"{n} {warm[n + '_ms']:.1f} ms" for n in warm["samples_ms"])
    ratios = ", ".join(
        f"{n}/GEMM {warm[n + '_over_gemm']:.3f} ({warm[n + '_ratio_range'][0]:.3f}-"
        f"{warm[n + '_ratio_range'][1]:.3f})"
        for n in list(warm["samples_ms"])[1:]
    )
    print(f"warm TTFT, {PREFIX} cached + {SUFFIX} new: {ways}; {ratios}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
