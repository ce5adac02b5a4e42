"""The C KV write and paged attention over float16 / bfloat16 caches, and the split of a row's
positions across threads: against torch's own rounding, naive float64 attention, and the
single-sweep kernel."""

from __future__ import annotations

import pytest
import torch

from prefixrag.kernels import cpu_ops
from tests.kernels.paged_batch import assert_close, make_paged_batch, naive_attention

HALF_TYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_write_kv_rounds_as_torch_does(dtype):
    gen = torch.Generator().manual_seed(1)
    num_slots, width = 40, 2 * 24  # 24: a row is not a whole number of 8-float vectors
    values = torch.randn(7, width, generator=gen) * torch.logspace(-9, 4, width)
    # ties of both types (1 + 2^-11, 1 + 2^-8 and their odd neighbours), overflow and NaN
    ties = [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 7e4, -1e39]
    values[0, :6] = torch.tensor(ties)
    values[1, 0] = float("nan")
    k, v = values.view(7, 2, 24), (-values).view(7, 2, 24)
    k_cache = torch.zeros(num_slots // 8, 8, 2, 24, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 0, 39, 12, 13, 31, 8])
    cpu_ops.write_kv(k, v, k_cache, v_cache, slots)
    got_k = k_cache.view(num_slots, 2, 24)[slots]
    got_v = v_cache.view(num_slots, 2, 24)[slots]
    # bit for bit what the torch paths store for the same rows (a NaN stays a NaN; torch's own
    # NaN bits differ between its scalar and vector paths)
    for got, want in ((got_k, k.to(dtype)), (got_v, v.to(dtype))):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(
            got.view(torch.int16)[~got.isnan()], want.view(torch.int16)[~got.isnan()]
        )


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("lens", [[1], [33], [300, 7], [1030, 257, 64]])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 20)])
def test_paged_decode_over_a_16bit_cache_matches_naive(
    dtype, lens, num_q_heads, num_kv_heads, head_dim
):
    batch = make_paged_batch(lens, num_kv_heads, head_dim, 16, dtype=dtype)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(2))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = cpu_ops.paged_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, head_dim**-0.5
    )
    # naive float64 over the very values the cache holds: only float32 math separates them
    naive = torch.cat(
        [
            naive_attention(q[b : b + 1], batch.keys[b], batch.values[b], n - 1, head_dim**-0.5)
            for b, n in enumerate(lens)
        ]
    )
    assert_close(out, naive, torch.float32)


def test_a_16bit_cache_stays_within_its_rounding_of_float32():
    # the same K/V in float32 and rounded to each type: the attention moves by the rounding only
    lens = [700]
    ref = make_paged_batch(lens, 3, 64, 16)
    q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(3))
    args = (ref.block_tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    exact = cpu_ops.paged_decode_attention(q, ref.k_cache, ref.v_cache, *args)
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        half = cpu_ops.paged_decode_attention(
            q, ref.k_cache.to(dtype), ref.v_cache.to(dtype), *args
        )
        torch.testing.assert_close(half, exact, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_positions_match_one_sweep(dtype):
    lens = [1000, 256, 257, 40]
    batch = make_paged_batch(lens, 3, 64, 16, dtype=dtype)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(4))
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, torch.tensor(lens).int(), 0.125)
    one_sweep = cpu_ops.paged_decode_attention(*args, split_len=1 << 20)
    for split_len in (32, 96, cpu_ops.SPLIT_LEN):
        split = cpu_ops.paged_decode_attention(*args, split_len=split_len)
        assert_close(split, one_sweep, torch.float32)
    # a row of one split is the single sweep itself
    split = cpu_ops.paged_decode_attention(*args)
    assert torch.equal(split[1], one_sweep[1]) and torch.equal(split[3], one_sweep[3])


def test_split_positions_are_the_same_bits_for_any_thread_count_and_batch():
    lens = [1500, 90, 600]
    batch = make_paged_batch(lens, 2, 32, 16, dtype=torch.float16)
    q = torch.randn(len(lens), 4, 32, generator=torch.Generator().manual_seed(5))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(
                cpu_ops.paged_decode_attention(
                    q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 0.2
                )
            )
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    alone = cpu_ops.paged_decode_attention(
        q[:1], batch.k_cache, batch.v_cache, batch.block_tables[:1], seq_lens[:1], 0.2
    )
    assert torch.equal(alone[0], outs[0][0])


def test_paged_attention_rejects_a_split_len_off_the_chunk_grid():
    batch = make_paged_batch([10], 1, 16, 8)
    q = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_ops.paged_decode_attention(
            q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            torch.tensor([10], dtype=torch.int32),
            1.0,
            split_len=48,
        )
