"""Engine overhead per decode step: scheduler + block/cache bookkeeping, with no model at all.

Runs 64 sequences (a shared system prefix plus their own text) through prefill, then times
``schedule()`` + ``postprocess()`` for many pure decode steps. Variants: prefix cache on, off,
and on with a full pool, where every new block has to evict a cached leaf first.

    python bench/engine_overhead.py [--steps 2000] [--seqs 64]

Writes bench/results/engine_overhead.json and .png and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from prefixrag.engine.config import EngineConfig
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.scheduler import Scheduler
from prefixrag.engine.sequence import Sequence

BLOCK_SIZE = 16
PREFIX_TOKENS = 256
OWN_TOKENS = 256
RESULTS = Path(__file__).parent / "results"


def drain(sched: Scheduler, rng: random.Random) -> None:
    while sched.has_unfinished():
        out = sched.schedule()
        sched.postprocess(out, [rng.randrange(1, 32000) for _ in range(out.num_samples)])


def build(variant: str, num_seqs: int, steps: int, rng: random.Random) -> Scheduler:
    blocks_per_seq = -(-(PREFIX_TOKENS + OWN_TOKENS + steps + 64) // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    config = EngineConfig(
        model="none",
        block_size=BLOCK_SIZE,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=2048,
        enable_prefix_cache=variant != "cache_off",
    )
    sched = Scheduler(config, num_blocks)
    if variant == "cache_on_full_pool":
        # cached leftovers fill the whole pool: every new block must evict a cached leaf first
        filler_len = 256
        for i in range(num_blocks * BLOCK_SIZE // filler_len + 1):
            prompt = [rng.randrange(1, 32000) for _ in range(filler_len)]
            sched.add(Sequence(10**6 + i, prompt, SamplingParams(max_tokens=1)))
        drain(sched, rng)
    return sched


def measure(variant: str, num_seqs: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    sched = build(variant, num_seqs, steps, rng)
    prefix = [rng.randrange(1, 32000) for _ in range(PREFIX_TOKENS)]
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    seqs = [
        Sequence(i, prefix + [rng.randrange(1, 32000) for _ in range(OWN_TOKENS)], params)
        for i in range(num_seqs)
    ]
    for seq in seqs:
        sched.add(seq)
    # prefill until every sequence decodes
    while sched.num_waiting or any(seq.num_uncomputed_tokens > 1 for seq in seqs):
        out = sched.schedule()
        sched.postprocess(out, [rng.randrange(1, 32000) for _ in range(out.num_samples)])
    timings_ns = []
    for _ in range(steps):
        sampled = [rng.randrange(1, 32000) for _ in range(num_seqs)]
        start = time.perf_counter_ns()
        out = sched.schedule()
        sched.postprocess(out, sampled)
        timings_ns.append(time.perf_counter_ns() - start)
        if len(out.seqs) != num_seqs or out.num_batched_tokens != num_seqs:
            raise RuntimeError(f"{variant}: expected a pure decode step of {num_seqs} sequences")
    us = sorted(t / 1000 for t in timings_ns)
    return {
        "variant": variant,
        "median_us": statistics.median(us),
        "p90_us": us[int(0.9 * (len(us) - 1))],
        "mean_us": statistics.fmean(us),
        "per_seq_median_us": statistics.median(us) / num_seqs,
        "evicted_blocks": sched.cache.evicted_blocks,
        "cache_hit_tokens": sched.cache.hit_tokens,
        "timings_us": [round(t / 1000, 2) for t in timings_ns],
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        ax.plot(r["timings_us"], label=f"{r['variant']} (median {r['median_us']:.0f} us)", lw=0.6)
    ax.set_xlabel("decode step")
    ax.set_ylabel("schedule + postprocess (us)")
    ax.set_yscale("log")
    ax.set_title("Engine overhead per decode step, no model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    variants = ["cache_on", "cache_off", "cache_on_full_pool"]
    results = [measure(v, args.seqs, args.steps, args.seed) for v in variants]
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "engine_overhead",
        "num_running_seqs": args.seqs,
        "steps": args.steps,
        "block_size": BLOCK_SIZE,
        "prompt_tokens": PREFIX_TOKENS + OWN_TOKENS,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": results,
    }
    plot(results, RESULTS / "engine_overhead.png")
    for r in results:
        del r["timings_us"]  # the plot has them; keep the JSON small
    (RESULTS / "engine_overhead.json").write_text(json.dumps(report, indent=1))
    print(f"engine overhead per decode step, {args.seqs} running sequences, {args.steps} steps:")
    for r in results:
        print(
            f"  {r['variant']:<20} median {r['median_us']:8.1f} us  p90 {r['p90_us']:8.1f} us  "
            f"({r['per_seq_median_us']:.2f} us/seq, evicted {r['evicted_blocks']} blocks)"
        )


if __name__ == "__main__":
    main()
