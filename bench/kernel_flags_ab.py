"""Builds of the C kernels with different compile-time settings, side by side in one engine.

A kernel tunable (a prefetch distance, say: ``BLOCK_PREFETCH_ROWS`` in
kernels/csrc/block_quant.h) is worth what it changes in a decode step, and a shared host's speed
drifts by a third within an hour, so two builds are comparable only when measured in one process,
interleaved. Each variant ``NAME=FLAGS`` builds the decode step (kernels/csrc/decode_step.c) and
the block matmul library (kernels/csrc/block_quant_matmul.c: the LM head and every other matmul
outside the C step) with FLAGS added to the usual ones. Every repeat runs each variant once on one
engine, each variant going first in turn; the first repeat is a warm-up. A variant's speed against
the first one is the median of the repeats' own ratios, reported with their range and every
sample. The builds may differ in speed only: a variant whose tokens differ from the first one's is
an error.

    python -m bench.kernel_flags_ab base= near=-DBLOCK_PREFETCH_ROWS=2
    python -m bench.kernel_flags_ab base= near=-DBLOCK_PREFETCH_ROWS=2 --gguf-type Q4_K_M \
        --int8-activations
    python -m bench.kernel_flags_ab base= near=-DSLOT_PREFETCH_ROWS=1 --weights fp32 --batch 8

Writes bench/results/kernel_flags_ab.json (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

from tqdm import tqdm

from bench.engine_bench import Ours, build_engine, corpus_ids, cpu_info, pin_threads
from bench.requantize import cached
from prefixrag.app.core.settings import get_settings, packaged_llm_path
from prefixrag.engine import quant
from prefixrag.engine.config import EngineConfig
from prefixrag.kernels import block_quant_matmul as bqm
from prefixrag.kernels import decode_step
from prefixrag.kernels.native_build import DEFAULT_FLAGS

RESULTS = Path(__file__).parent / "results"


def parse_variants(specs: list[str]) -> dict[str, tuple[str, ...]]:
    """``NAME=FLAGS`` strings to {name: extra compiler flags}, in the order given."""
    variants: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"a variant is NAME=FLAGS (FLAGS may be empty), got {spec!r}")
        if name in variants:
            raise ValueError(f"variant {name!r} is given twice")
        variants[name] = tuple(flags.split())
    if len(variants) < 2:
        raise ValueError("compare at least two variants")
    return variants


# the engine's C entry points as imported, before use_build wraps them
_DECODE_STEP_BUILD = decode_step.build
_BLOCK_QUANT_MATMUL = bqm.block_quant_matmul
_FIXED_ORDER_MATMUL = bqm.fixed_order_matmul


def use_build(extra: tuple[str, ...]) -> None:
    """Point the engine's C calls at the build with ``extra`` flags (each build is compiled once
    and cached by load_library). The engine looks these names up at call time."""
    flags = (*DEFAULT_FLAGS, *extra)
    decode_step.build = functools.partial(_DECODE_STEP_BUILD, flags)  # type: ignore[assignment]
    quant.block_quant_matmul = functools.partial(_BLOCK_QUANT_MATMUL, flags=flags)  # type: ignore[assignment]
    quant.fixed_order_matmul = functools.partial(_FIXED_ORDER_MATMUL, flags=flags)  # type: ignore[assignment]


def rotated(names: list[str], rep: int) -> list[str]:
    """Repeat ``rep``'s running order: each variant goes first in turn, so a host that is faster
    for whichever run comes first in a round favours none of them."""
    shift = rep % len(names)
    return names[shift:] + names[:shift]


def summarize(samples: dict[str, list[float]]) -> dict:
    """Per variant: its median tok/s, and its ratio to the first variant as the median of the
    repeats' own ratios (a repeat's runs are seconds apart, so the host's slower drift cancels
    in them), with the lowest and highest of those ratios and how many repeats it won."""
    first = next(iter(samples.values()))
    out = {}
    for name, values in samples.items():
        ratios = [v / f for v, f in zip(values, first, strict=True)]
        out[name] = {
            "median_tok_s": statistics.median(values),
            "vs_first": statistics.median(ratios),
            "vs_first_range": [min(ratios), max(ratios)],
            "repeats_faster_than_first": sum(r > 1 for r in ratios),
            "samples_tok_s": values,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", help="NAME=FLAGS, e.g. base= pf=-DX=1")
    parser.add_argument("--weights", choices=("gguf", "fp32"), default="gguf")
    parser.add_argument("--gguf-type", help="requantize the packaged model first (Q4_K_M)")
    parser.add_argument("--int8-activations", action="store_true")
    parser.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel_flags_ab.json")
    args = parser.parse_args()
    variants = parse_variants(args.variants)
    pin_threads(args.threads)

    model = str(cached(args.gguf_type) if args.gguf_type else packaged_llm_path())
    config = EngineConfig(
        model=model,
        cache_dir=str(get_settings().cache_dir / "models"),
        kv_cache_gb=0.5,
        max_num_batched_tokens=4096,
        int8_activations=args.int8_activations,
    )
    ours = Ours(build_engine(config, "gguf" if args.weights == "gguf" else "none", "auto"))
    prompts = [corpus_ids(ours.engine, args.context, offset=97 * i) for i in range(args.batch)]

    def run() -> tuple[float, list]:
        if args.batch == 1:
            tok_s, tokens = ours.decode(prompts[0], args.new_tokens)
            return tok_s, [tokens]
        return ours.concurrent(prompts, args.new_tokens)

    samples: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list] = {}
    names = list(variants)
    for rep in tqdm(range(args.repeats + 1), desc="repeats (the first warms up)"):
        for name in rotated(names, rep):
            use_build(variants[name])
            tok_s, out = run()
            tokens.setdefault(name, out)
            if rep:
                samples[name].append(tok_s)
    first = next(iter(variants))
    for name, out in tokens.items():
        if out != tokens[first]:
            raise SystemExit(f"variant {name} decoded other tokens than {first}: not a speed A/B")

    result = {
        "host": cpu_info(),
        "model": Path(model).name,
        "weights": args.weights,
        "int8_activations": args.int8_activations,
        "batch": args.batch,
        "context_tokens": args.context,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "unit": "tok/s" if args.batch == 1 else "tok/s, all sequences together",
        "variants": {name: list(extra) for name, extra in variants.items()},
        "results": summarize(samples),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{Path(model).name}, {args.weights}, batch {args.batch}, {args.repeats} repeats")
    for name, r in result["results"].items():
        flags = " ".join(variants[name]) or "(the usual flags)"
        low, high = r["vs_first_range"]
        print(
            f"  {name:12s} {r['median_tok_s']:8.1f} tok/s  {r['vs_first']:6.3f}x "
            f"({low:.2f}-{high:.2f}, faster in {r['repeats_faster_than_first']} of "
            f"{args.repeats})  {flags}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
