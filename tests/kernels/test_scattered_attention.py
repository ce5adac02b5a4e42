"""Scattered-query attention: reference vs naive float64 attention, Triton vs reference, and the
extend special case (every position of a chunk) against extend_attention_reference."""

import pytest
import torch

from prefixrag.kernels.extend_attention import extend_attention_reference
from prefixrag.kernels.scattered_attention import (
    scattered_attention,
    scattered_attention_reference,
)
from tests.kernels.paged_batch import assert_close, make_paged_batch, requires_gpu


def _positions(kind: str, seq_len: int, num: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "sorted":
        return sorted(torch.randperm(seq_len, generator=gen)[:num].tolist())
    if kind == "unsorted":
        return torch.randperm(seq_len, generator=gen)[:num].tolist()
    if kind == "repeats":  # drawn with replacement, so some positions come twice
        return torch.randint(seq_len, (num,), generator=gen).tolist()
    raise AssertionError(kind)


def _case(seq_len, positions, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype):
    # One sequence in shuffled blocks, its table padded with -1 and the spare blocks full of
    # garbage, so reading past a query's position or through a wrong block shows up.
    batch = make_paged_batch([seq_len], num_kv_heads, head_dim, block_size, dtype, device, seed=1)
    q = torch.randn(len(positions), num_q_heads, head_dim).to(dtype).to(device)
    q_positions = torch.tensor(positions, dtype=torch.int64, device=device)
    return batch, q, q_positions


def _naive(q, keys, values, positions, scale):
    """float64 by hand over the contiguous K/V: query i sees keys 0..positions[i]."""
    group = q.shape[1] // keys.shape[1]
    k64 = keys.cpu().double().repeat_interleave(group, dim=1)
    v64 = values.cpu().double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.cpu().double(), k64) * scale
    pos = torch.tensor(positions)
    visible = torch.arange(keys.shape[0])[None, :] <= pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), v64)


# (seq_len, position kind, N, q heads, kv heads, block size)
CASES = {
    "one_query_last": (45, "last", 1, 2, 2, 16),
    "one_query_first": (20, "first", 1, 6, 2, 4),
    "sorted_gqa1_bs16": (70, "sorted", 13, 2, 2, 16),
    "unsorted_gqa3_bs4": (53, "unsorted", 40, 6, 2, 4),
    "repeats_gqa3_bs16": (38, "repeats", 21, 3, 1, 16),
}


def _case_positions(seq_len, kind, num):
    if kind == "last":
        return [seq_len - 1]
    if kind == "first":
        return [0]
    return _positions(kind, seq_len, num, seed=seq_len)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_naive(case):
    seq_len, kind, num, num_q_heads, num_kv_heads, block_size = case
    positions = _case_positions(seq_len, kind, num)
    batch, q, q_positions = _case(
        seq_len, positions, num_q_heads, num_kv_heads, 32, block_size, "cpu", torch.float32
    )
    table = batch.block_tables[0]
    out = scattered_attention_reference(q, batch.k_cache, batch.v_cache, table, q_positions, 0.3)
    expected = _naive(q, batch.keys[0], batch.values[0], positions, 0.3)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_matches_reference(device, case):
    seq_len, kind, num, num_q_heads, num_kv_heads, block_size = case
    positions = _case_positions(seq_len, kind, num)
    batch, q, q_positions = _case(
        seq_len, positions, num_q_heads, num_kv_heads, 64, block_size, device, torch.float32
    )
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables[0], q_positions, 64**-0.5)
    expected = scattered_attention_reference(*args)
    assert_close(scattered_attention(*args), expected, torch.float32)
    # int32 positions, and the sync-free path where the caller vouches for kv_len.
    args_i32 = (*args[:4], q_positions.int(), args[5])
    assert_close(scattered_attention(*args_i32), expected, torch.float32)
    kv_len = max(positions) + 1
    assert_close(scattered_attention(*args, kv_len=kv_len), expected, torch.float32)


@pytest.mark.parametrize(
    ("prefix_len", "extend_len", "block_size"), [(0, 9, 4), (13, 20, 4), (16, 1, 16)]
)
def test_every_position_of_an_extend_is_extend_attention(
    device, prefix_len, extend_len, block_size
):
    # The scattered shape generalizes prefill: querying every position of an extend chunk must
    # give extend_attention_reference's result on the same cache.
    seq_len = prefix_len + extend_len
    positions = list(range(prefix_len, seq_len))
    batch, q, q_positions = _case(seq_len, positions, 6, 2, 64, block_size, device, torch.float32)
    lens = [torch.tensor([x], dtype=torch.int32, device=device) for x in (prefix_len, extend_len)]
    cu_extend = torch.tensor([0, extend_len], dtype=torch.int32, device=device)
    caches = (batch.k_cache, batch.v_cache)
    expected = extend_attention_reference(q, *caches, batch.block_tables, *lens, cu_extend, 0.125)
    table = batch.block_tables[0]
    assert_close(
        scattered_attention_reference(q, *caches, table, q_positions, 0.125),
        expected,
        torch.float32,
    )
    assert_close(
        scattered_attention(q, *caches, table, q_positions, 0.125), expected, torch.float32
    )


def test_empty_queries():
    batch, q, q_positions = _case(10, [], 4, 2, 16, 4, "cpu", torch.float32)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables[0], q_positions, 0.1)
    assert scattered_attention(*args).shape == (0, 4, 16)
    assert scattered_attention_reference(*args).shape == (0, 4, 16)


@pytest.mark.parametrize("fn", [scattered_attention, scattered_attention_reference])
def test_bad_input_raises(fn):
    batch, q, q_positions = _case(10, [3, 9, 0], 4, 2, 16, 4, "cpu", torch.float32)
    k_cache, v_cache, table = batch.k_cache, batch.v_cache, batch.block_tables[0]
    capacity = table.shape[0] * k_cache.shape[1]
    with pytest.raises(ValueError, match="too few for position"):
        fn(q, k_cache, v_cache, table, torch.tensor([1, capacity, 2]), 0.1)
    with pytest.raises(ValueError, match=">= 0"):
        fn(q, k_cache, v_cache, table, torch.tensor([1, -1, 2]), 0.1)
    with pytest.raises(ValueError, match="3 queries"):
        fn(q, k_cache, v_cache, table, q_positions[:2], 0.1)
    with pytest.raises(ValueError, match="int32 or int64"):
        fn(q, k_cache, v_cache, table, q_positions.float(), 0.1)
    with pytest.raises(ValueError, match="block_table must have 1 dims"):
        fn(q, k_cache, v_cache, batch.block_tables, q_positions, 0.1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        fn(q[:, :3], k_cache, v_cache, table, q_positions, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        fn(q[..., :8], k_cache, v_cache, table, q_positions, 0.1)
    with pytest.raises(ValueError, match="v_cache"):
        fn(q, k_cache, v_cache[:-1], table, q_positions, 0.1)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fn(q.double(), k_cache, v_cache, table, q_positions, 0.1)


def test_triton_only_checks():
    batch, q, q_positions = _case(10, [3, 9], 4, 2, 16, 4, "cpu", torch.float32)
    k_cache, v_cache, table = batch.k_cache, batch.v_cache, batch.block_tables[0]
    with pytest.raises(ValueError, match="must match the cache dtype"):
        scattered_attention(q.half(), k_cache, v_cache, table, q_positions, 0.1)
    # A trusted kv_len is still checked against the table, on the host.
    with pytest.raises(ValueError, match="too few"):
        scattered_attention(q, k_cache, v_cache, table, q_positions, 0.1, kv_len=1000)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["sorted", "unsorted"])
def test_gpu_large(dtype, kind):
    positions = _positions(kind, 3000, 500, seed=7)
    batch, q, q_positions = _case(3000, positions, 32, 8, 128, 16, "cuda", dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables[0], q_positions, 128**-0.5)
    assert_close(scattered_attention(*args), scattered_attention_reference(*args), dtype)
