"""Decode speed at batch 1: our ModelRunner vs transformers' generate on the same GGUF, CPU fp32.

Writes bench/results/model_bench.json and prints a summary. Greedy decoding on both sides; the
token sequences are compared as a sanity check.

    python -m bench.model_bench --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from prefixrag.app.core.settings import get_settings, packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem

PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]


def ours(runner: ModelRunner, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """Greedy decode; returns the new tokens and decode seconds (prefill excluded)."""
    blocks = list(range(-(-(len(prompt_ids) + new_tokens) // runner.block_size)))
    logits = runner.run([StepItem(prompt_ids, 0, blocks, True)])
    out = [int(logits[0].argmax())]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        pos = len(prompt_ids) + len(out) - 1
        logits = runner.run([StepItem(out[-1:], pos, blocks, True)])
        out.append(int(logits[0].argmax()))
    return out, time.perf_counter() - start


def reference(model, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """transformers generate; decode time = total minus a one-token generate (the prefill)."""
    ids = torch.tensor([prompt_ids])
    kwargs = {"do_sample": False, "pad_token_id": 2}
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return out[0, len(prompt_ids) :].tolist(), total - prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    cache_dir = get_settings().cache_dir
    start = time.perf_counter()
    runner = ModelRunner(
        EngineConfig(
            model=str(packaged_llm_path()),
            num_kv_blocks=64,
            cache_dir=str(cache_dir),
            kv_cache_dtype="float32",
        )
    )
    load_s = time.perf_counter() - start
    prompt_ids = runner.tokenizer.encode(runner.tokenizer.apply_chat_template(PROMPT))
    directory, name = os.path.split(packaged_llm_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()

    ours(runner, prompt_ids, 4)  # warm-up
    our_tokens, our_s = ours(runner, prompt_ids, args.new_tokens)
    ref_tokens, ref_s = reference(model, prompt_ids, args.new_tokens)
    steps = args.new_tokens - 1
    result = {
        "model": name,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        # this machine's CPUs are shared; a high load average makes every figure noisy
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        "runner_load_s": round(load_s, 3),
        "ours_decode_tok_s": round(steps / our_s, 2),
        "transformers_decode_tok_s": round(steps / ref_s, 2),
        "same_greedy_tokens": our_tokens == ref_tokens,
    }
    out = Path(__file__).parent / "results" / "model_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
