"""A 16-bit KV cache on CPU against the float32 one, on the packaged SmolLM2 (GGUF blocks, the C
decode step): greedy agreement and logits over a few hundred tokens, the split of long contexts
across threads, the torch backend over the same cache, and the chunk tiers' fingerprint."""

from __future__ import annotations

import pytest
import torch

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem, resolve_kv_dtype
from prefixrag.engine.native_decode import native_decode_stack
from tests.engine.llm_fixtures import make_engine

TEXT = (
    "The Rhine rises in the Swiss Alps and flows north to the North Sea, passing Basel, "
    "Strasbourg, Cologne and Rotterdam. Its valley has carried trade since Roman times, and the "
    "castles on its cliffs once collected tolls from every boat. Today barges carry coal, grain "
    "and containers between the ports, while trains run along both banks. "
)
NUM_DECODE = 160  # after a prompt of ~200 tokens: ~360 positions, two attention splits
TABLE = list(range(32))  # 512 slots of 16


@pytest.fixture(scope="module")
def runners(request: pytest.FixtureRequest) -> dict[str, ModelRunner]:
    cache_dir = request.config.cache.mkdir("prefixrag-engine-models")
    return {
        name: ModelRunner(
            EngineConfig(
                model=str(packaged_llm_path()),
                num_kv_blocks=len(TABLE),
                cache_dir=str(cache_dir),
                weight_quant="gguf",
                attention_backend=backend,
                kv_cache_dtype=kv,
            )
        )
        for name, backend, kv in (
            ("float32", "native", "float32"),
            ("float16", "native", "float16"),
            ("float16_torch", "torch", "float16"),
        )
    }


@pytest.fixture(scope="module")
def prompt(runners: dict[str, ModelRunner]) -> list[int]:
    return runners["float32"].tokenizer.encode(TEXT * 3)


def _greedy(runner: ModelRunner, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Logits of each step [steps, vocab] and the greedy tokens; ``forced`` feeds those tokens
    instead of the runner's own choices (so two runners see the same context)."""
    logits = [runner.run([StepItem(prompt, 0, TABLE)])[0]]
    chosen = [int(logits[0].argmax())]
    for i in range(steps - 1):
        token = forced[i] if forced is not None else chosen[-1]
        logits.append(runner.run([StepItem([token], len(prompt) + i, TABLE)])[0])
        chosen.append(int(logits[-1].argmax()))
    return torch.stack(logits), chosen


@pytest.fixture(scope="module")
def float32_run(runners, prompt):
    return _greedy(runners["float32"], prompt, NUM_DECODE)


def test_auto_is_float16_for_a_float32_model_on_cpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.float16
    assert resolve_kv_dtype(None, torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    # a backend that reads the cache in the model's dtype (Triton) keeps it
    assert resolve_kv_dtype("auto", torch.float32, cpu, can_narrow=False) == torch.float32
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_dtype("float16", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_dtype("float16", torch.float32, cpu, can_narrow=False)
    with pytest.raises(ValueError, match="unknown"):
        resolve_kv_dtype("int8", torch.float32, cpu)


def test_float16_kv_takes_the_c_step_and_half_the_bytes(runners):
    f32, f16 = runners["float32"], runners["float16"]
    assert f16.decode_stack is not None and f16.kv_pool.dtype == torch.float16
    assert 2 * f16.kv_bytes_per_token == f32.kv_bytes_per_token


def test_float16_kv_agrees_with_float32_greedy_and_in_logits(runners, prompt, float32_run):
    ref_logits, ref_ids = float32_run
    # the same context for both (float32's own tokens): logits differ by the KV rounding only
    logits, forced_ids = _greedy(runners["float16"], prompt, NUM_DECODE, forced=ref_ids)
    diff = (logits - ref_logits).abs().amax(dim=-1)
    print(
        f"float16 vs float32 KV, max |logit diff| per step: max {float(diff.max()):.3g}, "
        f"median {float(diff.median()):.3g}"
    )
    assert float(diff.max()) < 0.1, f"max |logit diff| {float(diff.max()):.3g}"
    assert float(diff.median()) < 0.02
    # the same choice at every step: so greedy decoding left to itself takes the same path
    assert forced_ids == ref_ids


def test_torch_backend_over_a_float16_cache_matches_the_c_step(runners, prompt, float32_run):
    _, ref_ids = float32_run
    c_logits, _ = _greedy(runners["float16"], prompt, 40, forced=ref_ids)
    torch_logits, _ = _greedy(runners["float16_torch"], prompt, 40, forced=ref_ids)
    # the same rounded K/V; fresh K/V computed in another summation order can round to the
    # neighbouring float16, so the bound is the KV rounding's, not float32's
    torch.testing.assert_close(c_logits, torch_logits, atol=2e-2, rtol=2e-2)
    assert torch.equal(c_logits.argmax(-1), torch_logits.argmax(-1))


def test_long_context_decode_is_the_same_bits_for_any_thread_count(runners, prompt):
    runner = runners["float16"]
    ids = prompt + prompt[:100]  # ~300 positions: two splits per row
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 3):  # 3 threads share its 6 tasks (2 splits x 3 kv heads) unevenly
            torch.set_num_threads(threads)
            runs.append(_greedy(runner, ids, 2)[0])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_split_positions_stay_within_rounding_of_one_sweep(runners, prompt):
    runner = runners["float16"]
    ids = prompt + prompt[:100]
    split = _greedy(runner, ids, 3)[0]
    one_sweep = native_decode_stack(runner.model, runner.kv_caches, runner.scale, split_len=1 << 20)
    assert one_sweep is not None
    default_stack, runner.decode_stack = runner.decode_stack, one_sweep
    try:
        single = _greedy(runner, ids, 3)[0]
    finally:
        runner.decode_stack = default_stack
    # the merge rounds differently (float32); a layer's fresh K/V may then round to the
    # neighbouring float16 in the cache, so the bound is float16's, ~2e-5 of the logits' size
    torch.testing.assert_close(split, single, atol=2e-3, rtol=2e-3)
    assert torch.equal(split.argmax(-1), single.argmax(-1))


def test_disk_tier_of_a_16bit_cache_is_its_own(request: pytest.FixtureRequest, tmp_path):
    f16 = make_engine(request, chunk_disk_dir=str(tmp_path / "kv"))
    f32 = make_engine(request, chunk_disk_dir=str(tmp_path / "kv"), kv_cache_dtype="float32")
    fp16, fp32 = f16.runner.kv_fingerprint(), f32.runner.kv_fingerprint()
    assert f16.runner.kv_dtype == torch.float16 and fp16["kv_dtype"] == "float16"
    # a float32 cache keeps the fingerprint (and the files) it had before 16-bit caches existed
    assert "kv_dtype" not in fp32
    assert f16.chunk_tiers.disk is not None and f32.chunk_tiers.disk is not None
    assert f16.chunk_tiers.disk.path != f32.chunk_tiers.disk.path
    # an entry's K/V leaves the pool and comes back bit for bit
    k = torch.randn(f16.runner.model_config.num_layers, 20, 3, 64).half()
    v = torch.randn_like(k, dtype=torch.float32).half()
    f16.runner.write_chunk([5, 6], k, v)
    back_k, back_v = f16.runner.read_chunk([5, 6], 20)
    assert back_k.dtype == torch.float16 and torch.equal(back_k, k) and torch.equal(back_v, v)
    f16.close()
    f32.close()


def test_the_setting_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch):
    from prefixrag.app.core.settings import Settings
    from prefixrag.app.services.llm import engine_config_from_settings

    monkeypatch.setenv("PREFIXRAG_KV_CACHE_DTYPE", "bfloat16")
    assert engine_config_from_settings(Settings()).kv_cache_dtype == "bfloat16"
    monkeypatch.setenv("PREFIXRAG_KV_CACHE_DTYPE", "int8")
    with pytest.raises(ValueError):
        Settings()
