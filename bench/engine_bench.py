"""Engine speed against Hugging Face transformers on the same model, side by side in one run.

Measures (medians over --repeats):
- TTFT of a 2,048-token shared prefix + 32-token new suffix, cold vs warm (prefix cached);
- prefill tokens/s, ours vs transformers (one forward over the same prompt);
- decode tokens/s at batch 1, ours vs transformers `generate`;
- aggregate decode tokens/s with 8 concurrent requests vs transformers run one after another;
- int8 weights (``weight_quant=int8``): every figure above for our engine with fp32 weights and
  with int8 weights side by side, interleaved so machine noise hits both, plus how many of the
  int8 engine's greedy decode tokens equal the fp32 engine's;
- gguf blocks (``weight_quant=gguf``): the same figures on the file's own Q4_1/Q8_0 blocks, and
  how many of its greedy tokens equal the fp32 engine's (the same matrices: all, barring ties);
- KV bytes per token against 2 * layers * kv_heads * head_dim * dtype bytes;
- engine overhead per decode step (scheduler + cache bookkeeping, no model) at 64 sequences.

Writes bench/results/engine_bench.json and .png, prints a summary.

    python -m bench.engine_bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from pathlib import Path

import torch
from tqdm import tqdm

from bench.engine_overhead import measure as measure_overhead
from prefixrag.app.core.settings import get_settings, packaged_llm_path
from prefixrag.engine.cache_scope import CacheScope
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
# A real long English text that every Debian machine has.
SOURCE_TEXT = Path("/usr/share/common-licenses/GPL-3")
# our engine's weight formats, keys of every per-engine figure: float32, per-channel int8 (bf16
# activations), and the GGUF file's own Q4_1/Q8_0 blocks (the same model as fp32, less to read)
WEIGHTS = ("fp32", "int8", "gguf")
GOALS = {"prefill": 1, "decode_batch1": 3, "concurrent": 5}


def build_engine(config: EngineConfig, weight_quant: str) -> LLMEngine:
    runner = ModelRunner(
        config.model,
        block_size=config.block_size,
        kv_cache_bytes=int(config.kv_cache_gb * 2**30),
        cache_dir=config.cache_dir,
        weight_quant=weight_quant,
    )
    return LLMEngine(config, runner=runner)


def corpus_ids(engine: LLMEngine, num_tokens: int, offset: int = 0) -> list[int]:
    ids = engine.tokenizer.encode(SOURCE_TEXT.read_text())
    if len(ids) < offset + num_tokens:
        raise ValueError(f"{SOURCE_TEXT} is too short for {offset + num_tokens} tokens")
    return ids[offset : offset + num_tokens]


def load_peer():
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(packaged_llm_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


def run_one(engine: LLMEngine, ids: list[int], params: SamplingParams, cache_scope: CacheScope):
    seq_id = engine.add_request(ids, params, cache_scope=cache_scope)
    while True:
        for event in engine.step():
            if event.seq_id == seq_id and hasattr(event.output, "ttft_s"):
                return event.output


def ttft_cold_warm(engine: LLMEngine, prefix: list[int], suffixes: list[list[int]]) -> dict:
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cold, warm, cached = [], [], []
    for suffix in tqdm(suffixes, desc="TTFT cold/warm"):
        # a fresh namespace sees an empty cache: a true cold start
        scope = CacheScope(namespace=uuid.uuid4().hex)
        cold.append(run_one(engine, prefix + suffix, one, scope).ttft_s)
        other = suffixes[(suffixes.index(suffix) + 1) % len(suffixes)]
        warm_result = run_one(engine, prefix + other, one, scope)
        warm.append(warm_result.ttft_s)
        cached.append(warm_result.cached_tokens)
    return {
        "cold_ttft_ms": 1000 * statistics.median(cold),
        "warm_ttft_ms": 1000 * statistics.median(warm),
        "warm_over_cold": statistics.median(warm) / statistics.median(cold),
        "warm_cached_tokens": statistics.median(cached),
    }


def peer_prefill_s(model, ids: list[int], repeats: int) -> float:
    x = torch.tensor([ids])
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            model(x, use_cache=False)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def peer_generate_s(model, ids: list[int], new_tokens: int) -> float:
    kwargs = {"do_sample": False, "pad_token_id": 0}
    x = torch.tensor([ids])
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        return time.perf_counter() - start


def decode_batch1(
    engines: dict, model, prompt: list[int], new_tokens: int, repeats: int
) -> tuple[dict, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ours: dict[str, list[float]] = {w: [] for w in engines}
    outputs: dict[str, list[int]] = {}
    peer = []
    for _ in tqdm(range(repeats), desc="batch-1 decode"):
        for w, engine in engines.items():
            out = run_one(engine, prompt, params, uuid.uuid4().bytes)
            ours[w].append(1 / out.tpot_s)
            outputs[w] = out.token_ids
        # decode time = a generate of N tokens minus a generate of 1 (its prefill)
        total = peer_generate_s(model, prompt, new_tokens)
        prefill_s = peer_generate_s(model, prompt, 1)
        peer.append((new_tokens - 1) / (total - prefill_s))
    peer_tok_s = statistics.median(peer)
    result: dict = {"transformers_tok_s": peer_tok_s}
    for w, speeds in ours.items():
        result[f"ours_{w}_tok_s"] = statistics.median(speeds)
        result[f"ratio_{w}"] = statistics.median(speeds) / peer_tok_s
    return result, [outputs[w] for w in engines]


def concurrent(
    engines: dict, model, prompts: list[list[int]], new_tokens: int
) -> tuple[dict, list[list[list[int]]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    result: dict = {"num_requests": len(prompts)}
    outputs = {}
    for w, engine in engines.items():
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        result[f"ours_{w}_s"] = time.perf_counter() - start
        result[f"ours_{w}_tok_s"] = (
            sum(r.completion_tokens for r in results) / result[f"ours_{w}_s"]
        )
        outputs[w] = [r.token_ids for r in results]
    total_tokens = len(prompts) * new_tokens
    peer_s = sum(peer_generate_s(model, p, new_tokens) for p in tqdm(prompts, desc="sequential"))
    result["transformers_sequential_tok_s"] = total_tokens / peer_s
    for w in engines:
        result[f"ratio_{w}"] = peer_s / result.pop(f"ours_{w}_s")
    return result, [outputs[w] for w in engines]


def teacher_forced_top1(config: EngineConfig, prompts: list[list[int]], fp32: list[list[int]]):
    """Fraction of the fp32 engine's greedy tokens that an int8 model also ranks first when fed
    the same text (prompt + fp32 tokens so far): per-token agreement without drift."""
    runner = ModelRunner(
        config.model, num_blocks=64, cache_dir=config.cache_dir, weight_quant="int8"
    )
    same = total = 0
    for prompt, out in zip(prompts, fp32, strict=True):
        ids = prompt + out[:-1]
        blocks = list(range(-(-len(ids) // runner.block_size)))
        logits = runner.run([StepItem(ids, 0, blocks)], all_logits=True)[len(prompt) - 1 :]
        same += int((logits.argmax(-1) == torch.tensor(out)).sum())
        total += len(out)
    return same / total


def greedy_agreement(fp32: list[list[int]], int8: list[list[int]]) -> dict:
    """Position-wise identical tokens, and tokens before each sequence's first difference
    (after a first difference the two continue from different text, so both are reported)."""
    same = total = prefix = 0
    for a, b in zip(fp32, int8, strict=True):
        total += len(a)
        same += sum(x == y for x, y in zip(a, b, strict=True))
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return {
        "num_sequences": len(fp32),
        "num_tokens": total,
        "identical_fraction": same / total,
        "before_first_difference_fraction": prefix / total,
    }


def prefill(engines: dict, model, prompt: list[int], repeats: int) -> dict:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    peer_s = peer_prefill_s(model, prompt, repeats)
    result: dict = {"prompt_tokens": len(prompt), "transformers_tok_s": len(prompt) / peer_s}
    for w, engine in engines.items():
        ours = [run_one(engine, prompt, params, uuid.uuid4().bytes).ttft_s for _ in range(repeats)]
        result[f"ours_{w}_tok_s"] = len(prompt) / statistics.median(ours)
        result[f"ratio_{w}"] = peer_s / statistics.median(ours)
    return result


def kv_bytes(engine: LLMEngine) -> dict:
    cfg, runner = engine.runner.model_config, engine.runner
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    expected = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    return {"measured": runner.kv_bytes_per_token, "expected": expected, "dtype": str(runner.dtype)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    names = [f"{kind}\n{w}" for w in WEIGHTS for kind in ("cold", "warm")]
    values = [result["ttft"][w][f"{kind}_ttft_ms"] for w in WEIGHTS for kind in ("cold", "warm")]
    left.bar(names, values, color=["#888", "#2a7"] * len(WEIGHTS))
    left.tick_params(axis="x", labelsize=8)
    left.set_ylabel("TTFT (ms)")
    left.set_title(f"{result['prefix_tokens']}-token prefix + {result['suffix_tokens']} new")
    x = range(len(GOALS))
    width = 0.8 / len(WEIGHTS)
    for i, (w, color) in enumerate(zip(WEIGHTS, ("#36c", "#e80", "#2a7"), strict=True)):
        ratios = [result[key][f"ratio_{w}"] for key in GOALS]
        offset = (i - (len(WEIGHTS) - 1) / 2) * width
        right.bar([p + offset for p in x], ratios, width, color=color, label=f"ours {w}")
    right.scatter(list(x), list(GOALS.values()), color="red", marker="_", s=1500, label="goal")
    right.set_xticks(
        list(x), ["prefill", "decode b=1", f"decode x{result['concurrent']['num_requests']}"]
    )
    right.set_ylabel("speed-up over transformers (x)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_bench.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    settings = get_settings()
    config = EngineConfig(
        model=packaged_llm_path(),
        cache_dir=str(settings.cache_dir / "models"),
        kv_cache_gb=1.0,
        max_num_batched_tokens=4096,
    )
    engines = {w: build_engine(config, "none" if w == "fp32" else w) for w in WEIGHTS}
    engine = engines["fp32"]
    model = load_peer()
    prefix = corpus_ids(engine, args.prefix_tokens)
    step = args.suffix_tokens
    suffixes = [
        corpus_ids(engine, step, args.prefix_tokens + i * step) for i in range(args.repeats + 1)
    ]
    chat_prompt = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
        )
    )
    concurrent_prompts = [corpus_ids(engine, 64, 4000 + 64 * i) for i in range(args.concurrency)]

    for e in engines.values():
        run_one(e, chat_prompt, SamplingParams(max_tokens=4), b"warm-up")
    decode, decode_ids = decode_batch1(
        engines, model, chat_prompt, args.decode_tokens, args.repeats
    )
    many, many_ids = concurrent(engines, model, concurrent_prompts, args.decode_tokens)
    result = {
        "model": os.path.basename(config.model),
        "device": str(engine.runner.device),
        "torch_threads": torch.get_num_threads(),
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "ttft": {w: ttft_cold_warm(e, prefix, suffixes) for w, e in engines.items()},
        "prefill": prefill(engines, model, prefix + suffixes[0], args.repeats),
        "decode_batch1": decode,
        "concurrent": many,
        "int8_greedy_agreement_with_fp32": greedy_agreement(
            [decode_ids[0], *many_ids[0]], [decode_ids[1], *many_ids[1]]
        ),
        "gguf_greedy_agreement_with_fp32": greedy_agreement(
            [decode_ids[0], *many_ids[0]], [decode_ids[2], *many_ids[2]]
        ),
        "int8_teacher_forced_top1_with_fp32": teacher_forced_top1(
            config, [chat_prompt, *concurrent_prompts], [decode_ids[0], *many_ids[0]]
        ),
        "kv_bytes_per_token": kv_bytes(engine),
    }
    overhead = measure_overhead("cache_on", 64, 500, 0)
    result["step_overhead_us_at_64_seqs"] = overhead["median_us"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    summarize(result, args)
    print(f"engine overhead per decode step at 64 seqs: {overhead['median_us']:.0f} us")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def summarize(result: dict, args: argparse.Namespace) -> None:
    for w in WEIGHTS:
        t = result["ttft"][w]
        print(
            f"TTFT {args.prefix_tokens}+{args.suffix_tokens} ({w}): "
            f"cold {t['cold_ttft_ms']:.0f} ms, "
            f"warm {t['warm_ttft_ms']:.0f} ms -> warm/cold {t['warm_over_cold']:.3f} (goal <= 0.05)"
        )
    for key, goal in GOALS.items():
        r = result[key]
        ratios = ", ".join(f"{w} {r[f'ratio_{w}']:.2f}x" for w in WEIGHTS)
        print(f"{key}: ours/transformers = {ratios} (goal >= {goal}x)  {r}")
    print(f"int8 greedy agreement with fp32: {result['int8_greedy_agreement_with_fp32']}")
    print(f"gguf greedy agreement with fp32: {result['gguf_greedy_agreement_with_fp32']}")
    top1 = result["int8_teacher_forced_top1_with_fp32"]
    print(f"int8 top-1 = fp32's greedy token, fed fp32's text: {top1:.3f}")
    print(f"KV bytes/token: {result['kv_bytes_per_token']}")


if __name__ == "__main__":
    main()
