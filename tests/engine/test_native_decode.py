"""The one-call C decode step against the torch model on the same GGUF block weights."""

from __future__ import annotations

import pytest
import torch

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.kernels.decode_step import MAX_ROWS

BLOCK = 8


def _runner(cache_dir, backend: str, weight_quant: str, q8: bool = False) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model=str(packaged_llm_path()),
            block_size=BLOCK,
            num_kv_blocks=128,
            cache_dir=str(cache_dir),
            weight_quant=weight_quant,
            attention_backend=backend,
            int8_activations=q8,
            kv_cache_dtype="float32",
        )
    )


@pytest.fixture(scope="module")
def runners(tmp_path_factory) -> dict[str, ModelRunner]:
    cache_dir = tmp_path_factory.mktemp("native-decode")
    return {
        backend + ("_q8" if q8 else ""): _runner(cache_dir, backend, "gguf", q8)
        for backend in ("native", "torch")
        for q8 in (False, True)
    }


def _prefill_then_decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list:
    """Prefill each prompt in its own blocks, then decode ``steps`` tokens for all of them
    together (greedy); returns each step's logits [B, vocab]."""
    tables, lens, nxt = [], [], []
    for i, ids in enumerate(prompts):
        table = list(range(i * 16, (i + 1) * 16))
        logits = runner.run([StepItem(ids, 0, table)])
        tables.append(table)
        lens.append(len(ids))
        nxt.append(int(logits[0].argmax()))
    out = []
    for _ in range(steps):
        items = [StepItem([t], n, tb) for t, n, tb in zip(nxt, lens, tables, strict=True)]
        logits = runner.run(items)
        out.append(logits)
        nxt = [int(row.argmax()) for row in logits]
        lens = [n + 1 for n in lens]
    return out


@pytest.fixture(scope="module")
def float32_runners(tmp_path_factory) -> dict[str, ModelRunner]:
    """The packaged model dequantized to plain float32 matrices (weight_quant none)."""
    cache_dir = tmp_path_factory.mktemp("native-decode-fp32")
    return {backend: _runner(cache_dir, backend, "none") for backend in ("native", "torch")}


def test_a_float32_model_decodes_in_the_c_step_as_the_torch_model_does(float32_runners):
    native, torch_runner = float32_runners["native"], float32_runners["torch"]
    assert native.decode_stack is not None and torch_runner.decode_stack is None
    prompts = _prompts(native)
    ours = _prefill_then_decode(native, prompts, 6)
    ref = _prefill_then_decode(torch_runner, prompts, 6)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    # a row decoded beside others gets the bits it gets alone
    alone = _prefill_then_decode(native, prompts[:1], 3)
    for a, b in zip(alone, ours[:3], strict=True):
        assert torch.equal(a[0], b[0])


def test_gguf_runner_takes_the_c_step_only_under_the_native_backend(runners):
    assert runners["native"].decode_stack is not None
    assert runners["torch"].decode_stack is None
    assert runners["native_q8"].decode_stack.int8_activations


def _prompts(runner: ModelRunner) -> list[list[int]]:
    tok = runner.tokenizer
    return [
        tok.encode("The Rhine rises in the Swiss Alps and flows"),
        tok.encode("Paged attention stores the KV cache in blocks, so"),
        tok.encode("1, 2, 3, 4, 5,"),
    ]


@pytest.mark.parametrize("q8", ["", "_q8"], ids=["float32", "int8_activations"])
def test_c_decode_step_matches_the_torch_model(runners, q8):
    # with int8 activations the torch model's matmuls quantize their inputs the same way
    native = _prefill_then_decode(runners["native" + q8], _prompts(runners["native"]), 6)
    torch_path = _prefill_then_decode(runners["torch" + q8], _prompts(runners["native"]), 6)
    for ours, ref in zip(native, torch_path, strict=True):
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        if not q8:  # same weights, same float32 math; only summation order differs
            torch.testing.assert_close(ours, ref, atol=2e-3, rtol=2e-3)
        else:  # an ulp apart upstream flips some int8 roundings: int8 noise, not float32's
            assert cosine(ours, ref) > 0.99


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()


def test_int8_activations_stay_near_the_float32_logits(runners):
    q8 = _prefill_then_decode(runners["native_q8"], _prompts(runners["native"]), 6)
    exact = _prefill_then_decode(runners["native"], _prompts(runners["native"]), 6)
    for a, b in zip(q8, exact, strict=True):
        assert not torch.equal(a, b)  # the int8 path did run
        # x rounded to 8 bits per block of 32 (about 0.4% of its largest element), as
        # llama.cpp's decode does: measured 0.9965 at worst over these steps
        assert cosine(a, b) > 0.99
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("q8", ["", "_q8"], ids=["float32", "int8_activations"])
def test_c_decode_step_is_batch_invariant(runners, q8):
    runner = runners["native" + q8]
    tok = runner.tokenizer
    prompt = tok.encode("A sequence decoded alone or beside others")
    other = tok.encode("gets the same logits, bit for bit, because")
    alone = _prefill_then_decode(runner, [prompt], 3)
    together = _prefill_then_decode(runner, [prompt, other, other[:5]], 3)
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a[0], b[0])


def test_c_decode_step_rejects_a_block_table_too_short(runners):
    runner = runners["native"]
    stack = runner.decode_stack
    x = torch.zeros(1, stack.hidden)
    before = runner.kv_caches[0][0].clone()
    with pytest.raises(ValueError, match="out of range"):
        stack.run(
            x,
            torch.tensor([20]),
            torch.tensor([20]),
            torch.tensor([[0, 1]], dtype=torch.int32),  # 16 slots for 21 tokens
            torch.tensor([21], dtype=torch.int32),
        )
    assert torch.equal(runner.kv_caches[0][0], before)
    with pytest.raises(ValueError, match="rows"):
        stack.run(
            torch.zeros(MAX_ROWS + 1, stack.hidden),
            *(torch.zeros(MAX_ROWS + 1, dtype=torch.int64),) * 2,
            torch.zeros(MAX_ROWS + 1, 1, dtype=torch.int32),
            torch.ones(MAX_ROWS + 1, dtype=torch.int32),
        )


def test_int8_activations_is_a_bool_or_auto_and_in_the_cache_fingerprint(runners, tmp_path):
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="int8_activations"):
            EngineConfig(model="random", int8_activations=bad)  # type: ignore[arg-type]
    # auto leaves the packaged model's Q4_1 / Q8_0 planes in float32
    auto = ModelRunner(
        EngineConfig(
            model=str(packaged_llm_path()),
            block_size=BLOCK,
            num_kv_blocks=8,
            weight_quant="gguf",
            kv_cache_dtype="float32",
        )
    )
    assert not auto.int8_activations
    # KV written with int8 activations is not reused by an engine without them, and back
    q8 = runners["native_q8"].kv_fingerprint()
    exact = runners["native"].kv_fingerprint()
    assert q8 != exact and q8["activations"] == "int8" and "activations" not in exact
