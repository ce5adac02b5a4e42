"""End-to-end part of bench/kernels_bench.py: our LLMEngine on a Llama-3.1-8B-shaped model with
random bf16 weights (nothing can be fetched), on the default CUDA path (Triton attention, norm and
RoPE).

Reports decode tokens/s at batch 1, 16 and 64 against the memory-bandwidth bound (every step reads
all weights once plus each sequence's KV), eager and with each step replayed from a CUDA graph,
and the time to first token of a 16k-token prompt, cold and with its first 15k tokens already in
the prefix cache. Each measured run follows an identical untimed one, so Triton compiles,
graph captures and allocator warm-up stay out of the figures.
"""

from __future__ import annotations

import time

import torch

from prefixrag.engine.config import EngineConfig
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.model_config import ModelConfig, RopeScaling
from prefixrag.engine.model_runner import ModelRunner
from prefixrag.engine.outputs import GenerationDelta
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.tokenizer import Tokenizer

LLAMA_31_8B = ModelConfig(
    architecture="llama",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
)
BLOCK_SIZE = 16
DECODE_BATCHES = (1, 16, 64)
DECODE_PROMPT, DECODE_NEW = 128, 128
TTFT_PROMPT, TTFT_CACHED = 16384, 15360
NUM_KV_BLOCKS = 4096  # 64k tokens: the largest batch or one 16k prompt with room to spare
MAX_BATCHED_TOKENS = 8192


def build_runner(config: ModelConfig = LLAMA_31_8B, device: str = "cuda") -> ModelRunner:
    """The random-weight bf16 runner, with the device's default backend (Triton on CUDA)."""
    return ModelRunner.from_config(
        config,
        Tokenizer.word_level(config.vocab_size),
        EngineConfig(
            model="<random weights>",
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_KV_BLOCKS,
            device=device,
            dtype="bfloat16",
            attention_backend="auto",
            max_model_len=32768,
            kv_cache_dtype="bfloat16",
        ),
    )


def _engine(runner: ModelRunner, graphs: bool = True) -> LLMEngine:
    # A fresh engine has an empty prefix cache; the runner (weights, KV pool) is shared.
    # Without graphs, a runner that captured them earlier replays none.
    if not graphs:
        runner.decode_graphs = None
    config = EngineConfig(
        model="random-weights",
        block_size=BLOCK_SIZE,
        num_kv_blocks=runner.num_blocks,
        max_num_seqs=max(DECODE_BATCHES),
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        device=runner.device.type,
        cuda_graphs=graphs,
    )
    return LLMEngine(config, runner=runner)


def _sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def _prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    return [(seed * 7919 + i * 31) % (vocab_size - 2) + 1 for i in range(length)]


def _decode_run(runner: ModelRunner, batch: int, graphs: bool) -> tuple[int, float]:
    """Decode tokens produced after every sequence has its first token, and the seconds taken."""
    engine = _engine(runner, graphs)
    params = SamplingParams(max_tokens=DECODE_NEW, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(_prompt(b, DECODE_PROMPT, runner.vocab_size), params)
    started: set[int] = set()
    num_tokens, start = 0, 0.0
    while engine.has_unfinished():
        deltas = [e for e in engine.step() if isinstance(e.output, GenerationDelta)]
        if start:
            num_tokens += sum(len(e.output.token_ids) for e in deltas)
        else:
            started.update(e.seq_id for e in deltas if e.output.token_ids)
            if len(started) == batch:  # every prompt is prefilled: decode timing starts now
                _sync(runner)
                start = time.perf_counter()
    _sync(runner)
    return num_tokens, time.perf_counter() - start


def _weight_bytes(runner: ModelRunner) -> int:
    # A decode step reads every weight once, except the embedding table (one row per token).
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head_weight is None:  # tied: the table is read in full as the LM head
        return total
    return total - model.embed_weight.numel() * model.embed_weight.element_size()


def bench_decode(runner: ModelRunner, peak_tbps: float, graphs: bool) -> list[dict[str, float]]:
    """Decode tokens/s per batch size and its fraction of the bandwidth bound, eager or with
    steps replayed from CUDA graphs."""
    weight_bytes = _weight_bytes(runner)
    mean_context = DECODE_PROMPT + DECODE_NEW / 2
    results = []
    for batch in DECODE_BATCHES:
        _decode_run(runner, batch, graphs)  # compiles and warms up the shapes measured next
        num_tokens, seconds = _decode_run(runner, batch, graphs)
        step_bytes = weight_bytes + batch * mean_context * runner.kv_bytes_per_token
        bound = batch * peak_tbps * 1e12 / step_bytes
        measured = num_tokens / seconds
        results.append(
            {
                "batch": batch,
                "tokens_per_s": measured,
                "ms_per_step": 1e3 * seconds / (num_tokens / batch),
                "bandwidth_bound_tokens_per_s": bound,
                "fraction_of_bound": measured / bound,
            }
        )
    return results


def _ttft(runner: ModelRunner, prompt: list[int], cached: int) -> tuple[float, int]:
    engine = _engine(runner)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    if cached:
        engine.generate([prompt[:cached]], one)
    _sync(runner)
    start = time.perf_counter()
    result = engine.generate([prompt], one)[0]
    return time.perf_counter() - start, result.cached_tokens


def bench_ttft(runner: ModelRunner) -> dict[str, float]:
    """TTFT of a 16k-token prompt, cold and with a 15k-token cached prefix (one request alone)."""
    prompt = _prompt(12345, TTFT_PROMPT, runner.vocab_size)
    _ttft(runner, prompt[:4096], 3072)  # warm-up: chunked prefill and extend over a prefix
    cold_s, cold_cached = _ttft(runner, prompt, 0)
    warm_s, warm_cached = _ttft(runner, prompt, TTFT_CACHED)
    return {
        "prompt_tokens": TTFT_PROMPT,
        "ttft_cold_s": cold_s,
        "ttft_cached_s": warm_s,
        "cached_tokens_cold": cold_cached,
        "cached_tokens_warm": warm_cached,
        "speedup": cold_s / warm_s,
    }


def bench_engine(
    peak_tbps: float, config: ModelConfig = LLAMA_31_8B, device: str = "cuda"
) -> dict[str, object]:
    """Build the model once, run both measurements, and free its memory again."""
    start = time.perf_counter()
    runner = build_runner(config, device)
    build_s = time.perf_counter() - start
    backend = type(runner.backend).__name__ + (
        " + fused norm/rope" if runner.backend.fused_ops else ""
    )
    try:
        # eager first: the runner then captures its graphs once, for the rest
        eager = bench_decode(runner, peak_tbps, graphs=False)
        try:
            decode: list[dict[str, float]] | str = bench_decode(runner, peak_tbps, graphs=True)
        except Exception as exc:  # a failed capture must not lose the eager figures
            decode = f"failed: {type(exc).__name__}: {exc}"
        ttft = bench_ttft(runner)
    finally:
        del runner
        if device == "cuda":
            torch.cuda.empty_cache()
    return {
        "model": {**config.to_dict(), "weights": "random bf16"},
        "backend": backend,
        "build_s": build_s,
        "decode_prompt_tokens": DECODE_PROMPT,
        "decode_new_tokens": DECODE_NEW,
        "decode": decode,
        "decode_eager": eager,
        "ttft_16k": ttft,
    }
