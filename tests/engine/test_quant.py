"""Weight-only int8: the quantizer's error bound, the int8 matmul against a dequantized reference,
and the int8 model against the fp32 model on the packaged SmolLM2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine import quant
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.engine.quant import (
    Int8Weight,
    block_kernel_max_rows,
    dequantize,
    linear,
    quantize_per_channel,
    resolve_weight_quant,
)
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.kernels.block_quant_matmul import BlockQuantWeight, block_quant_dequantize
from tests.engine.llm_fixtures import model_cache_dir
from tests.kernels.test_block_quant_matmul import random_gguf_blocks

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Ünïcödé ✓ and emoji 🎉 — 日本語のテキスト, then numbers 3.14159 and 2718281828.",
    "Explain in two sentences why the sky is blue.",
]


def _weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    # Rows of very different magnitude, one all-zero: per-channel scales must follow each row.
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 2, rows).unsqueeze(1)
    w[rows // 2] = 0
    return w


def test_round_trip_error_is_at_most_half_a_step_per_channel():
    w = _weights(37, 50)
    q, scales = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scales.shape == (37,)
    assert int(q.abs().max()) <= 127
    err = (dequantize(q, scales) - w).abs()
    # round-to-nearest on a grid of step `scale`: no element is more than half a step off
    bound = scales[:, None] / 2 * (1 + 1e-5)
    assert bool((err <= bound).all())
    # each nonzero row's largest element lands on +-127: the full int8 range is used
    nonzero = w.abs().amax(1) > 0
    assert bool((q.abs().amax(1)[nonzero] == 127).all())
    assert bool((q[~nonzero] == 0).all())


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_per_channel(torch.ones(3, 4, 5))
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_per_channel(torch.ones(3, 4, dtype=torch.int32))


@pytest.mark.parametrize(
    ("lead", "out_features", "in_features"),
    [
        ((1,), 96, 64),  # one decode token
        ((8,), 33, 576),  # odd row count, the model's hidden size
        ((2, 5), 17, 48),  # extra leading dims
        ((3,), 10, 40),  # K not a multiple of 16: the dequantize-then-matmul path
        ((300,), 64, 1536),  # a prefill-sized batch: dequantize, then the float matmul
    ],
)
def test_int8_matmul_matches_dequantized_reference(lead, out_features, in_features):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(*lead, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    weight = Int8Weight(w)
    ours = linear(x, weight, bias)
    assert ours.dtype == x.dtype and ours.shape == (*lead, out_features)
    # Reference in float64 on the dequantized int8 matrix and bf16-rounded activations (what the
    # int8 kernel sees; the large-batch path uses exact x, within a bf16 step of it). The kernel
    # accumulates in fp32 and rounds its output to bf16 (relative 2^-8): that sets the tolerance.
    x_bf16 = x.to(torch.bfloat16).double()
    expected = x_bf16 @ weight.dequantize().double().T + bias.double()
    scale = (x_bf16.abs() @ weight.dequantize().double().abs().T).amax()
    torch.testing.assert_close(ours.double(), expected, atol=float(scale) * 2**-8, rtol=2**-8)


@pytest.mark.parametrize("in_features", [64, 72])  # the kernel's path, and the fallback's
def test_a_rows_result_does_not_depend_on_the_batch_it_is_in(in_features):
    # Batch invariance: a token must get the same logits alone, in a decode batch or in a long
    # prefill chunk, or greedy output would change with the prefix cache or preemption.
    weight = Int8Weight(_weights(96, in_features))
    x = torch.randn(600, in_features, generator=torch.Generator().manual_seed(3))
    full = weight.matmul(x)
    for rows in (1, 5, 64, 257, 600):
        assert torch.equal(weight.matmul(x[:rows]), full[:rows]), rows


def test_int8_matmul_is_close_to_the_float_matmul():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(128, 576, generator=gen)
    x = torch.randn(4, 576, generator=gen)
    exact = x @ w.T
    ours = linear(x, Int8Weight(w))
    # int8 steps (1/254 of a row's max) and bf16 inputs add independent errors of under 1% of
    # an output's typical size; a wrong scale or a transposed weight is off by 100% or more.
    rel = (ours - exact).norm() / exact.norm()
    assert float(rel) < 0.02


def test_weight_quant_choices_are_validated():
    cpu = torch.device("cpu")
    assert resolve_weight_quant("auto", cpu, torch.float32, "/models/m.GGUF") == "gguf"
    assert resolve_weight_quant("auto", cpu, torch.float32, "/models/llama-hf") == "none"
    assert resolve_weight_quant("auto", cpu, torch.float32) == "none"
    assert resolve_weight_quant("auto", cpu, torch.bfloat16, "m.gguf") == "none"
    assert resolve_weight_quant("auto", torch.device("cuda"), torch.float32, "m.gguf") == "none"
    assert resolve_weight_quant("none", cpu, torch.float32) == "none"
    with pytest.raises(ValueError, match="weight_quant must be one of"):
        resolve_weight_quant("int4", cpu, torch.float32)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_weight_quant("int8", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="weight_quant must be one of"):
        EngineConfig(model="m.gguf", weight_quant="fp8")


@pytest.fixture(scope="module")
def runners(request) -> dict[str, ModelRunner]:
    cache_dir = model_cache_dir(request)
    return {
        q: ModelRunner(
            EngineConfig(
                model=str(packaged_llm_path()),
                block_size=8,
                num_kv_blocks=64,
                cache_dir=str(cache_dir),
                weight_quant=q,
                kv_cache_dtype="float32",
            )
        )
        for q in ("none", "int8")
    }


def test_int8_model_holds_int8_weights(runners):
    model = runners["int8"].model
    layer = model.layers[0]
    for weight in (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.down_weight):
        assert isinstance(weight, Int8Weight)
    assert isinstance(model.lm_head_weight, Int8Weight)
    assert not isinstance(runners["none"].model.layers[0].attn.qkv_weight, Int8Weight)


def test_int8_logits_stay_close_to_fp32(runners):
    tok = runners["none"].tokenizer
    cosines, agree, total = [], 0, 0
    for text in PROMPTS:
        ids = tok.encode(text)
        blocks = list(range(-(-len(ids) // 8)))
        full, int8 = (
            runners[q].run([StepItem(ids, 0, blocks)], all_logits=True) for q in ("none", "int8")
        )
        assert not torch.equal(full, int8)  # the int8 path really ran
        cosines.append(torch.nn.functional.cosine_similarity(full, int8, dim=-1))
        agree += int((full.argmax(-1) == int8.argmax(-1)).sum())
        total += len(ids)
    # Per-channel int8 weights and bf16 activations each perturb every matmul by well under 1%;
    # over 30 layers the logit vectors stay within cos 0.98 of fp32 (measured >= 0.989: the bf16
    # rounding amplifies last-bit float32 differences, so the minimum moves between 0.989 and
    # 0.992 with the backend's op order). Top-1 may flip only where the fp32 top two nearly tie,
    # so >= 90% of positions must agree (measured 100%). Unscaled or misordered weights give
    # cosines near 0.
    assert float(torch.cat(cosines).min()) > 0.98
    assert agree / total >= 0.9


SHARED = (
    "You are a careful assistant. Answer from the sources below.\n"
    "[1] The Rhine rises in the Swiss Alps and flows north to the North Sea.\n"
    "[2] The Danube rises in the Black Forest and flows east to the Black Sea.\n"
)
QUESTIONS = ["Question: Which river reaches the North Sea?\nAnswer:", "Question: Where?\nAnswer:"]


def _int8_engine(request, *, enable_prefix_cache: bool) -> LLMEngine:
    config = EngineConfig(
        model=packaged_llm_path(),
        cache_dir=model_cache_dir(request),
        block_size=16,
        num_kv_blocks=128,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        enable_prefix_cache=enable_prefix_cache,
        weight_quant="int8",
        kv_cache_dtype="float32",
    )
    return LLMEngine(config)


def _has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(ln.startswith("flags") and " avx512f" in ln for ln in f)


# NOTE: torch's int8 kernel (_weight_int8pack_mm) sums a row differently by batch on AVX2-only
# hosts (a 2-core AMD EPYC: the second prompt's greedy tokens part at token 15 with the cache
# on, on the code before the mapped loader too); on AVX-512 hosts a row's result stands alone
@pytest.mark.skipif(not _has_avx512(), reason="int8 rows depend on the batch without AVX-512")
def test_int8_greedy_output_is_the_same_with_prefix_cache_on_and_off(request):
    # Requests one at a time, and a batch of fully cached prompts. Mixed batches of prefills and
    # decodes can differ under int8 (bf16 activations amplify batching's rounding), which is why
    # int8 is opt-in (see EngineConfig); the default float path is checked in every mix.
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    on = _int8_engine(request, enable_prefix_cache=True)
    off = _int8_engine(request, enable_prefix_cache=False)
    prompts = [on.tokenizer.encode(SHARED + q) for q in QUESTIONS]
    expected = [off.generate([p], params)[0].token_ids for p in prompts]
    first = on.generate([prompts[0]], params)[0]
    second = on.generate([prompts[1]], params)[0]  # its shared prefix now comes from the cache
    assert second.cached_tokens >= 16
    assert [first.token_ids, second.token_ids] == expected
    both = on.generate(prompts, params)  # both fully cached prompts in one batch
    assert [r.token_ids for r in both] == expected


def test_gguf_weight_quant_needs_cpu_float32_and_a_gguf_file(tmp_path):
    cpu = torch.device("cpu")
    assert resolve_weight_quant("gguf", cpu, torch.float32) == "gguf"
    with pytest.raises(ValueError, match="CPU in float32"):
        resolve_weight_quant("gguf", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="CPU in float32"):
        resolve_weight_quant("gguf", torch.device("cuda"), torch.float32)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"needs a \.gguf checkpoint"):
        ModelRunner(
            EngineConfig(
                model=str(tmp_path), num_kv_blocks=4, weight_quant="gguf", kv_cache_dtype="float32"
            )
        )


def test_a_matrix_wider_than_the_kernel_is_refused_by_name(monkeypatch):
    from prefixrag.engine.weights import gguf_blocks

    config = gguf_blocks.map_gguf(packaged_llm_path()).config
    # a row buffer narrower than the MLP width: down_proj (K = intermediate) cannot run
    monkeypatch.setattr(gguf_blocks, "MAX_K", config.intermediate_size - 1)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight: tensor type Q4_1"):
        gguf_blocks.map_gguf(packaged_llm_path())


@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_float32_linear_takes_the_fixed_order_kernel_up_to_16_rows(rows):
    from prefixrag.engine.quant import linear
    from prefixrag.kernels.block_quant_matmul import fixed_order_matmul

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(70, 96, generator=gen)
    bias = torch.randn(70, generator=gen)
    x = torch.randn(1, rows, 96, generator=gen)
    out = linear(x, weight, bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
    fixed = fixed_order_matmul(x[0], weight) + bias
    # decode-sized: the C kernel's bits, whatever rows share the call; a prefill: MKL's GEMM
    assert torch.equal(out[0], fixed) == (rows <= 16)
    if rows <= 16:
        assert torch.equal(linear(x[:, :1], weight, bias)[0, 0], out[0, 0])


@pytest.mark.parametrize("rows", [1, 16, 17, 40, 64, 65])
def test_block_linear_gives_tens_of_rows_a_decode_steps_bits(rows):
    # a new question of tens of tokens after cached documents: on a build with the block
    # kernel's tiles (AVX-512) up to TILE_KERNEL_MAX_ROWS rows take them, with each row's bits
    # what it gets alone (a decode step), unless the host has AMX, whose path takes them up to
    # AMX_MAX_ROWS at float32 accuracy; past them, the GEMM over the dequantized matrix
    from prefixrag.engine import quant
    from prefixrag.kernels.block_quant_matmul import (
        BlockQuantWeight,
        block_quant_dequantize,
        tile_min_rows,
    )

    gen = torch.Generator().manual_seed(rows)
    n, k = 50, 192
    weight = BlockQuantWeight(
        "q4",
        torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
        torch.rand(n, k // 32, generator=gen) / 50,
        -torch.rand(n, k // 32, generator=gen) / 10,
    )
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)
    out = quant.linear(x, weight)
    dense = block_quant_dequantize(weight)
    torch.testing.assert_close(out, x @ dense.T, atol=1e-3, rtol=1e-4)
    alone = torch.cat([quant.linear(x[r : r + 1], weight) for r in range(rows)])
    tiles = tile_min_rows() > 0
    amx = quant._amx_build() and rows <= quant.AMX_MAX_ROWS
    decode_bits = rows <= quant.BLOCK_KERNEL_MAX_ROWS or (
        tiles and not amx and rows <= quant.TILE_KERNEL_MAX_ROWS
    )
    assert torch.equal(out, alone) == decode_bits


@pytest.mark.parametrize("int8", [False, True])
def test_kquant_rows_keep_the_block_kernel_for_a_short_extend(int8):
    """File rows (Q4_K) take the block kernel up to block_kernel_max_rows: every row of a short
    extend gets exactly the bits it gets decoded alone; past it, the GEMM over the widened
    matrix, close to them but not the same arithmetic."""
    from prefixrag.engine.quant import block_kernel_max_rows, linear
    from prefixrag.kernels.block_quant_matmul import BlockQuantWeight, block_quant_dequantize
    from prefixrag.kernels.block_stack import BlockStack
    from tests.kernels.test_block_quant_matmul import random_gguf_blocks

    n, k = 24, 512
    w = BlockQuantWeight("q4_k", torch.from_numpy(random_gguf_blocks("Q4_K", n, k, 3)), None, None)
    v = BlockQuantWeight("q6_k", torch.from_numpy(random_gguf_blocks("Q6_K", 8, k, 4)), None, None)
    stack = BlockStack((w, v))
    for weight in (w, v):
        weight.int8_activations = int8
    limit = block_kernel_max_rows(w)
    assert limit == block_kernel_max_rows(stack) > 16
    x = torch.randn(limit + 1, k, generator=torch.Generator().manual_seed(0))
    for weight in (w, stack):
        alone = torch.cat([linear(x[i : i + 1], weight) for i in range(limit)])
        assert torch.equal(linear(x[:limit], weight), alone)
    dense = x.double() @ block_quant_dequantize(w).double().T
    past = linear(x, w).double()
    # int8 activations round x to 8 bits, and so does a bfloat16 GEMM (bf16_prefill) x and W
    tol = 0.02 if int8 or quant.bf16_prefill() else 1e-5
    assert (past - dense).norm() < tol * dense.norm()
    assert not torch.equal(past[:limit].float(), linear(x[:limit], w))


def _kquant_weight(rows: int, k: int) -> BlockQuantWeight:
    raw = random_gguf_blocks("Q4_K", rows, k, seed=rows)
    return BlockQuantWeight("q4_k", torch.from_numpy(raw), None, None)


def test_a_prefill_sized_matmul_widens_to_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch):
    w = _kquant_weight(40, 512)
    rows = block_kernel_max_rows(w) + 8  # past the block kernel: the widened matrix's GEMM
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(1))
    dense = block_quant_dequantize(w)
    exact = x.double() @ dense.double().T
    monkeypatch.setattr(quant, "bf16_prefill", lambda: True)
    on = quant.linear(x, w)
    assert on.dtype == torch.float32
    assert torch.equal(on, F.linear(x.bfloat16(), dense.bfloat16()).float())
    monkeypatch.setattr(quant, "bf16_prefill", lambda: False)
    off = quant.linear(x, w)
    assert torch.equal(off, F.linear(x, dense))
    # bfloat16's 8 significant bits of x and W: about the error of int8 activations
    scale = exact.abs().max()
    assert (off.double() - exact).abs().max() < 1e-5 * scale
    assert 1e-5 * scale < (on.double() - exact).abs().max() < 2e-2 * scale


def test_bfloat16_prefill_follows_the_cpu_flags_and_the_setting(monkeypatch):
    for flags, setting, expected in [
        ({"avx2", "avx512_bf16"}, "auto", True),
        ({"avx2", "amx_bf16"}, None, True),
        ({"avx2", "avx512f"}, "auto", False),  # bfloat16 emulated: slower than float32
        ({"avx512_bf16"}, "off", False),
    ]:
        monkeypatch.setattr(quant, "cpu_flags", lambda flags=flags: frozenset(flags))
        if setting is None:
            monkeypatch.delenv("PREFIXRAG_PREFILL_BF16", raising=False)
        else:
            monkeypatch.setenv("PREFIXRAG_PREFILL_BF16", setting)
        quant.bf16_prefill.cache_clear()
        try:
            assert quant.bf16_prefill() is expected, (flags, setting)
        finally:
            quant.bf16_prefill.cache_clear()
