"""The KV cache's dtype on CPU at a long context: float32 against float16 and bfloat16.

Two figures, each interleaved over --repeats (every round runs every variant once, in turn), with
medians and the 1-minute load average before and after (the machine may be shared):

- kernel: the C paged decode attention (kernels/cpu_ops) of one SmolLM2-135M layer (9 query heads,
  3 KV heads, head_dim 64) over --context cached positions, per KV dtype, with the positions split
  across threads (cpu_ops.SPLIT_LEN) and in one sweep per (row, KV head);
- decode: whole batch-1 decode steps of the packaged SmolLM2 (GGUF blocks, the one-call C step)
  after a --context-token prompt, per KV dtype (no scheduler: ModelRunner.run alone).

Writes bench/results/kv_dtype_bench.json and prints a table.

    python -m bench.kv_dtype_bench [--threads 2] [--context 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from prefixrag.app.core.settings import get_settings, packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.kernels import cpu_ops

RESULTS = Path(__file__).parent / "results"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
ONE_SWEEP = 1 << 30


def kernel_case(dtype: torch.dtype, context: int):
    num_blocks = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen).int().unsqueeze(0)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen)
    lens = torch.tensor([context], dtype=torch.int32)
    return q, k, v, table, lens


def time_kernel(case, split_len: int, calls: int) -> float:
    """Microseconds per call."""
    q, k, v, table, lens = case
    start = time.perf_counter()
    for _ in range(calls):
        cpu_ops.paged_decode_attention(q, k, v, table, lens, 0.125, split_len=split_len)
    return 1e6 * (time.perf_counter() - start) / calls


def kernel_figures(context: int, repeats: int, calls: int) -> dict:
    cases = {name: kernel_case(dtype, context) for name, dtype in DTYPES.items()}
    variants = [(n, s) for n in DTYPES for s in ("split", "one_sweep")]
    samples: dict[str, list[float]] = {f"{n}/{s}": [] for n, s in variants}
    for name, _ in variants:  # warm-up: library built, pages touched
        time_kernel(cases[name], cpu_ops.SPLIT_LEN, 3)
    for _ in range(repeats):
        for name, split in variants:
            split_len = cpu_ops.SPLIT_LEN if split == "split" else ONE_SWEEP
            samples[f"{name}/{split}"].append(time_kernel(cases[name], split_len, calls))
    kv_bytes = 2 * context * KV_HEADS * HEAD_DIM
    return {
        key: {
            "us_per_call": statistics.median(values),
            "kv_gb_per_s": kv_bytes
            * DTYPES[key.split("/")[0]].itemsize
            / statistics.median(values)
            / 1e3,
            "samples_us": values,
        }
        for key, values in samples.items()
    }


def decode_figures(context: int, steps: int, repeats: int) -> dict:
    settings = get_settings()
    table = list(range(-(-(context + steps * (repeats + 1)) // BLOCK)))
    runners = {
        name: ModelRunner(
            EngineConfig(
                model=str(packaged_llm_path()),
                num_kv_blocks=len(table),
                block_size=BLOCK,
                cache_dir=str(settings.cache_dir / "models"),
                weight_quant="gguf",
                kv_cache_dtype=name,
            )
        )
        for name in DTYPES
    }
    vocab = runners["float32"].vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(1))
    state = {}
    for name, runner in runners.items():
        logits = runner.run([StepItem(prompt.tolist(), 0, table)])
        state[name] = (context, int(logits[0].argmax()))
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            pos, token = state[name]
            start = time.perf_counter()
            for _ in range(steps):
                logits = runner.run([StepItem([token], pos, table)])
                pos, token = pos + 1, int(logits[0].argmax())
            samples[name].append(steps / (time.perf_counter() - start))
            state[name] = (pos, token)
    return {
        name: {
            "tok_s": statistics.median(values),
            "kv_bytes_per_token": runners[name].kv_bytes_per_token,
            "samples_tok_s": values,
        }
        for name, values in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernel-calls", type=int, default=200)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_dtype_bench.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the C kernels' OpenMP team too (torch's libgomp)
    load_before = os.getloadavg()[0]
    kernel = kernel_figures(args.context, args.repeats, args.kernel_calls)
    decode = decode_figures(args.context, args.decode_steps, args.repeats)
    result = {
        "context": args.context,
        "threads": args.threads,
        "split_len": cpu_ops.SPLIT_LEN,
        "repeats": args.repeats,
        "kernel_shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "kernel": kernel,
        "decode": decode,
        "load_avg_1m": {"before": load_before, "after": os.getloadavg()[0]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{args.context}-token context, {args.threads} threads, medians of {args.repeats}")
    print("kernel (one layer's attention):")
    for key, row in kernel.items():
        print(f"  {key:<20} {row['us_per_call']:8.1f} us  {row['kv_gb_per_s']:6.2f} GB/s of KV")
    print("decode steps (batch 1, C step):")
    for key, row in decode.items():
        print(f"  KV {key:<10} {row['tok_s']:7.1f} tok/s  ({row['kv_bytes_per_token']} B/token)")
    print(f"1-minute load: {load_before:.1f} before, {result['load_avg_1m']['after']:.1f} after")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
