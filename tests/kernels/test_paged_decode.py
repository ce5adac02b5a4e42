"""Paged decode attention: reference vs naive float64 attention, Triton vs reference."""

import pytest
import torch

from prefixrag.kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from tests.kernels.paged_batch import assert_close, make_paged_batch, naive_attention, requires_gpu

GQA = [(2, 2), (6, 2), (8, 1)]  # (q heads, kv heads): ratios 1, 3, 8
BATCHES = [[1], [16], [17], [5, 33, 8], [40, 1, 24, 9]]


def _decode_case(lens, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype, pad=-1):
    batch = make_paged_batch(lens, num_kv_heads, head_dim, block_size, dtype, device, pad=pad)
    q = torch.randn(len(lens), num_q_heads, head_dim).to(dtype).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return batch, q, seq_lens


def _naive(batch, q, lens, scale):
    rows = [
        naive_attention(q[b : b + 1], batch.keys[b], batch.values[b], n - 1, scale)
        for b, n in enumerate(lens)
    ]
    return torch.cat(rows)


@pytest.mark.parametrize("lens", BATCHES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("block_size", [8, 16, 5])
def test_reference_matches_naive(lens, num_q_heads, num_kv_heads, block_size):
    batch, q, seq_lens = _decode_case(
        lens, num_q_heads, num_kv_heads, 32, block_size, "cpu", torch.float32
    )
    out = paged_decode_attention_reference(
        q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 0.2
    )
    assert_close(out, _naive(batch, q, lens, 0.2), torch.float32)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_matches_reference_heads(device, head_dim, num_q_heads, num_kv_heads, num_splits):
    lens = [5, 40, 17]
    batch, q, seq_lens = _decode_case(
        lens, num_q_heads, num_kv_heads, head_dim, 16, device, torch.float32
    )
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, head_dim**-0.5)
    expected = paged_decode_attention_reference(*args)
    assert_close(paged_decode_attention(*args, num_splits=num_splits), expected, torch.float32)


@pytest.mark.parametrize("lens", BATCHES)
@pytest.mark.parametrize(("block_size", "pad"), [(8, -1), (16, 0), (32, -1)])
def test_triton_matches_reference_lengths(device, lens, block_size, pad):
    batch, q, seq_lens = _decode_case(lens, 6, 2, 64, block_size, device, torch.float32, pad)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 0.125)
    expected = paged_decode_attention_reference(*args)
    assert_close(paged_decode_attention(*args), expected, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_split_k_covers_short_and_long_sequences(device, num_splits):
    # More splits than a short sequence has tiles: its empty splits must weigh nothing.
    lens = [3, 70, 33]
    batch, q, seq_lens = _decode_case(lens, 8, 1, 64, 8, device, torch.float32)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 0.125)
    out = paged_decode_attention(*args, num_splits=num_splits)
    assert_close(out, _naive(batch, q, lens, 0.125), torch.float32)


@pytest.mark.slow
def test_triton_long_context_many_splits(device):
    lens = [700, 129, 1]
    batch, q, seq_lens = _decode_case(lens, 24, 8, 128, 16, device, torch.float32)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 128**-0.5)
    for num_splits in (None, 1, 9):
        out = paged_decode_attention(*args, num_splits=num_splits)
        assert_close(out, paged_decode_attention_reference(*args), torch.float32)


def test_bad_input_raises():
    batch, q, seq_lens = _decode_case([4], 6, 4, 64, 8, "cpu", torch.float32)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 0.1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(*args)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention_reference(*args)
    batch, q, seq_lens = _decode_case([4], 4, 2, 64, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(
            q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens.float(), 0.1
        )
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(
            q[..., :32], batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 0.1
        )
    with pytest.raises(ValueError, match=">= 1"):
        paged_decode_attention_reference(
            q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens * 0, 0.1
        )


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_large(dtype, num_splits):
    lens = [3000, 1, 517, 4096]
    batch, q, seq_lens = _decode_case(lens, 32, 8, 128, 16, "cuda", dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 128**-0.5)
    out = paged_decode_attention(*args, num_splits=num_splits)
    assert_close(out, paged_decode_attention_reference(*args), dtype)
