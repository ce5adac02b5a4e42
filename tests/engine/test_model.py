"""Our Llama-family model against transformers on the same weights: the packaged SmolLM2 GGUF and
tiny random Llama / Qwen2 / Mistral checkpoints saved as Hugging Face safetensors directories."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem

ATOL = RTOL = 2e-4  # fp32 on both sides; only summation order may differ
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Ünïcödé ✓ and emoji 🎉 — 日本語のテキスト, then numbers 3.14159 and 2718281828.",
]


@pytest.fixture(scope="module", params=["none", "gguf"])
def runner(request) -> ModelRunner:
    # The pytest cache keeps converted weights between runs, so only the first run dequantizes.
    # "gguf" keeps the file's own Q4_1/Q8_0 blocks: the same matrices, read by the block kernel.
    cache_dir = request.config.cache.mkdir("prefixrag-engine-models")
    return ModelRunner(
        EngineConfig(
            model=str(packaged_llm_path()),
            block_size=8,
            num_kv_blocks=64,
            cache_dir=str(cache_dir),
            weight_quant=request.param,
            kv_cache_dtype="float32",
        )
    )


@pytest.fixture(scope="module")
def hf_model():
    directory, name = os.path.split(packaged_llm_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def prompt_ids(runner) -> list[list[int]]:
    return [runner.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_prompt_logits(hf_model, prompt_ids) -> list[torch.Tensor]:
    return [hf_logits(hf_model, ids) for ids in prompt_ids]


def test_prefill_logits_match_transformers(runner, prompt_ids, hf_prompt_logits):
    for ids, expected in zip(prompt_ids, hf_prompt_logits, strict=True):
        blocks = list(range(-(-len(ids) // runner.block_size)))
        ours = runner.run([StepItem(ids, 0, blocks, True)], all_logits=True)
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)


def test_paged_decode_steps_match_transformers(runner, hf_model, prompt_ids):
    ids = list(prompt_ids[0])
    num_prompt = len(ids)
    blocks = [9, 3, 17, 4, 30]  # scattered on purpose: reads must follow the block table
    step_logits = [runner.run([StepItem(ids, 0, blocks, True)])[0]]
    for _ in range(6):
        ids.append(int(step_logits[-1].argmax()))
        step_logits.append(runner.run([StepItem(ids[-1:], len(ids) - 1, blocks, True)])[0])
    # one causal forward over the final sequence gives the reference for every decode step
    expected = hf_logits(hf_model, ids)[num_prompt - 1 :]
    torch.testing.assert_close(torch.stack(step_logits), expected, atol=ATOL, rtol=RTOL)


def test_mixed_batch_matches_transformers_per_sequence(runner, prompt_ids, hf_prompt_logits):
    a, b, c = prompt_ids
    blocks_a, blocks_b, blocks_c = list(range(40, 43)), list(range(50, 60)), list(range(10, 20))
    runner.run([StepItem(a[:-1], 0, blocks_a, False), StepItem(b[:-1], 0, blocks_b, False)])
    # two decodes (a, b) and one fresh prefill (c), in an order that is not decode-first
    logits = runner.run(
        [
            StepItem(c, 0, blocks_c, True),
            StepItem(a[-1:], len(a) - 1, blocks_a, True),
            StepItem(b[-1:], len(b) - 1, blocks_b, True),
        ]
    )
    expected = torch.stack([hf_prompt_logits[i][-1] for i in (2, 0, 1)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)


def _randomize(model: torch.nn.Module) -> None:
    # Default init leaves norms at 1 and biases at 0; random values make every weight matter.
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.dim() == 1 else 0.0))


COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}
TINY_MODELS = {
    "llama3-rope": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    ),
    "llama-linear-tied": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True
        )
    ),
    "qwen2-qkv-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
}


@pytest.mark.parametrize("kind", list(TINY_MODELS))
def test_tiny_hf_checkpoints_match_transformers(kind, tmp_path):
    reference = TINY_MODELS[kind]().eval()
    _randomize(reference)
    reference.save_pretrained(tmp_path)
    runner = ModelRunner(
        EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=32, kv_cache_dtype="float32")
    )
    ids = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    ids = ids.tolist()
    blocks = list(range(31, 19, -1))
    ours = runner.run([StepItem(ids[:-2], 0, blocks, True)], all_logits=True)
    expected = hf_logits(reference, ids)
    torch.testing.assert_close(ours, expected[:-2], atol=ATOL, rtol=RTOL)
    for pos in (len(ids) - 2, len(ids) - 1):
        step = runner.run([StepItem(ids[pos : pos + 1], pos, blocks, True)])
        torch.testing.assert_close(step[0], expected[pos], atol=ATOL, rtol=RTOL)
