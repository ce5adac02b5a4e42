"""The async front end: concurrent requests batch together, cancellation frees blocks at once."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from prefixrag.engine.async_engine import AsyncEngine
from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling.params import SamplingParams
from tests.engine.llm_fixtures import make_engine

PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):",
    "Paris is the capital of",
    "Once upon a time, in a small village,",
    "The boiling point of water at sea level is",
]


@pytest.fixture(scope="module")
def engine(request):
    eng = AsyncEngine(make_engine(request, num_kv_blocks=128, max_num_seqs=8))
    yield eng
    eng.shutdown()


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams):
    deltas, result = [], None
    async for item in engine.generate(prompt, params):
        if isinstance(item, GenerationDelta):
            deltas.append(item.text)
        else:
            result = item
    return "".join(deltas), result


def test_concurrent_requests_match_one_at_a_time_and_batch(engine):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def main():
        alone = [await collect(engine, p, params) for p in PROMPTS]
        batch_sizes: list[int] = []

        async def watch():
            while True:
                stats = await engine.call(lambda e: e.cache_stats())
                batch_sizes.append(stats["num_running"])
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(watch())
        together = await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS))
        watcher.cancel()
        return alone, together, max(batch_sizes)

    alone, together, most_running = asyncio.run(main())
    for (text_a, res_a), (text_b, res_b) in zip(alone, together, strict=True):
        assert res_a.token_ids == res_b.token_ids
        assert text_a == res_a.text and text_b == res_b.text
        assert res_b.completion_tokens == 24 and res_b.finish_reason == "length"
    assert most_running > 1  # they really ran in one batch


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        before = await engine.call(lambda e: e.cache_stats())
        stream = engine.generate(PROMPTS[3], params)
        got = 0
        async for item in stream:
            got += isinstance(item, GenerationDelta)
            if got == 3:
                break
        await stream.aclose()
        after = await engine.call(lambda e: e.cache_stats())
        return before, after

    before, after = asyncio.run(main())
    assert after["num_running"] == 0 and after["num_waiting"] == 0
    # Only cache-owned blocks stay in use; the request's private blocks went back to the pool.
    assert after["blocks_used"] == after["blocks_cached"]
    assert after["blocks_used"] >= before["blocks_used"]


def test_stop_string_and_bad_prompt(engine):
    async def main():
        full_text, _ = await collect(
            engine, PROMPTS[1], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        )
        stop = full_text.strip().split()[1]
        text, result = await collect(
            engine, PROMPTS[1], SamplingParams(max_tokens=32, temperature=0.0, stop=[stop])
        )
        with pytest.raises(ValueError, match="context window"):
            await collect(engine, [1] * (engine.max_model_len + 1), SamplingParams(max_tokens=1))
        return full_text, stop, text, result

    full_text, stop, text, result = asyncio.run(main())
    assert isinstance(result, GenerationResult)
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert text == full_text[: full_text.index(stop)]


def test_stop_after_pattern_keeps_the_match_and_ends_the_output(engine):
    async def main():
        full_text, _ = await collect(
            engine, PROMPTS[1], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        )
        word = full_text.strip().split()[1]
        pattern = re.escape(word)
        params = SamplingParams(max_tokens=32, temperature=0.0, stop_after=[pattern])
        text, result = await collect(engine, PROMPTS[1], params)
        return full_text, word, pattern, text, result

    full_text, word, pattern, text, result = asyncio.run(main())
    assert isinstance(result, GenerationResult)
    assert result.finish_reason == "stop" and result.stop_reason == pattern
    end = full_text.index(word) + len(word)
    assert text == result.text == full_text[:end]
    assert result.completion_tokens < 32


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(engine):
    runner = engine.engine.runner
    real_run = runner.run

    def fail_once(items, **kwargs):
        runner.run = real_run
        raise RuntimeError("injected fault")

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main():
        runner.run = fail_once
        with pytest.raises(RuntimeError, match="injected fault"):
            await collect(engine, PROMPTS[0], params)
        _, result = await collect(engine, PROMPTS[0], params)
        stats = await engine.call(lambda e: e.cache_stats())
        return result, stats

    result, stats = asyncio.run(main())
    assert result.finish_reason == "length" and result.completion_tokens == 8
    assert stats["num_running"] == 0 and stats["blocks_used"] == stats["blocks_cached"]


def test_a_burst_bigger_than_the_kv_pool_queues_preempts_and_finishes(request, engine):
    # 12 requests of ~50 tokens need ~4 blocks of 16 each: ~48 blocks against a pool of 10.
    # The prefix cache is off so that every request needs its own blocks.
    small = AsyncEngine(
        make_engine(request, num_kv_blocks=10, max_num_seqs=8, enable_prefix_cache=False)
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [f"{p} (variant {i})" for i in range(3) for p in PROMPTS[:4]]

    async def main():
        reference = [await collect(engine, p, params) for p in prompts]
        burst = await asyncio.gather(*(collect(small, p, params) for p in prompts))
        stats = await small.call(lambda e: e.cache_stats())
        return reference, burst, stats

    try:
        reference, burst, stats = asyncio.run(main())
    finally:
        small.shutdown()
    # A recomputed sequence's generated tokens are prefilled again, in prefill's arithmetic (a
    # GEMM past 32 rows, and their K/V rounded to float16 from other bits) where they were
    # decoded before: its greedy tokens may part only at a near tie of the reference's top two,
    # and then to the reference's second choice. A lost or misplaced block parts them anywhere.
    same = 0
    for (_, expected), (text, got) in zip(reference, burst, strict=True):
        assert got.finish_reason == "length" and len(got.token_ids) == 40
        assert text == got.text
        pairs = zip(expected.token_ids, got.token_ids, strict=True)
        part = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if part is None:
            same += 1
            continue
        (_, lp_first), (second, lp_second) = expected.logprobs[part].top
        assert lp_first - lp_second < 0.01 and got.token_ids[part] == second, part
    assert same >= len(prompts) - 2
    assert stats["num_preemptions"] > 0  # the pool really ran out and requests were recomputed
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["blocks_used"] == 0  # every block came back


def test_the_prefix_peek_races_evictions_and_sees_whole_states(request):
    # A reader on another thread peeks at a cached prompt's length without pause while the
    # engine thread fills a small pool and evicts it. Every answer must be a state some step
    # left: whole blocks of the prompt, never an error or a half-made walk; once the engine is
    # quiet the peek equals the live tree's own count, read on the engine thread.
    small = AsyncEngine(make_engine(request, num_kv_blocks=24, max_num_seqs=2))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    block_size = small.engine.scheduler.cache.block_size
    prompt = small.tokenizer.encode(" ".join(PROMPTS))
    seen: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def peek_forever() -> None:
        while not stop.is_set():
            try:
                seen.append(small.cached_prefix_len(prompt))
            except BaseException as exc:  # the test's own failure, reported below
                failures.append(exc)
                return

    async def main():
        await collect(small, prompt, params)
        cached = small.cached_prefix_len(prompt)
        reader = threading.Thread(target=peek_forever)
        reader.start()
        try:
            for i in range(12):  # other prompts that need the whole pool: the first is evicted
                await collect(small, f"{i} {' '.join(PROMPTS[::-1])}", params)
        finally:
            stop.set()
            reader.join()
        live = await small.call(lambda e: e.scheduler.cache.prefix_len(prompt))
        evicted = await small.call(lambda e: e.scheduler.cache.evicted_blocks)
        return cached, live, evicted

    try:
        cached, live, evicted = asyncio.run(main())
    finally:
        small.shutdown()
    assert not failures, failures
    assert cached >= 2 * block_size and evicted > 0
    assert seen and all(n % block_size == 0 and 0 <= n <= cached for n in seen)
    assert small.cached_prefix_len(prompt) == live < cached  # evicted, and the peek knows it
