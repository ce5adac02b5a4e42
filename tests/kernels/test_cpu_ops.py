"""The C ops of the CPU step against the plain-torch references (and naive float64 attention)."""

from __future__ import annotations

import pytest
import torch

from prefixrag.kernels import cpu_ops
from prefixrag.kernels.kv_write import write_kv_reference
from prefixrag.kernels.paged_decode import paged_decode_attention_reference
from prefixrag.kernels.rms_norm import rms_norm_reference
from prefixrag.kernels.rope import apply_rope_reference_
from tests.kernels.paged_batch import assert_close, make_paged_batch, naive_attention
from tests.kernels.test_block_quant_matmul import ALL_FLAGS


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen) * 3
    residual = torch.randn(rows, 96, generator=gen) if with_residual else None
    weight = torch.randn(96, generator=gen)
    x_before = x.clone()
    out, s = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_s = rms_norm_reference(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_s, atol=0, rtol=0)
    assert torch.equal(x, x_before)


def test_rms_norm_rejects_bad_input():
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_rope_matches_reference_on_qkv_slices(tokens):
    heads, kv_heads, dim = 6, 2, 64
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    cache = torch.randn(300, dim, generator=gen)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    # views into the fused qkv rows, as the model hands them over
    ours = qkv.clone()
    q, k = (
        ours[:, : heads * dim].view(tokens, heads, dim),
        ours[:, heads * dim :][:, : kv_heads * dim],
    )
    k = k.view(tokens, kv_heads, dim)
    ref = qkv.clone()
    rq = ref[:, : heads * dim].view(tokens, heads, dim)
    rk = ref[:, heads * dim :][:, : kv_heads * dim].view(tokens, kv_heads, dim)
    cpu_ops.apply_rope_(q, k, positions, cache)
    apply_rope_reference_(rq, rk, positions, cache)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # v, the last columns, is not touched
    assert torch.equal(ours[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])


def test_rope_rejects_positions_past_the_cache_and_touches_nothing():
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    before = q.clone()
    with pytest.raises(ValueError, match="positions"):
        cpu_ops.apply_rope_(q, k, torch.tensor([0, 10]), torch.randn(10, 8))
    assert torch.equal(q, before)


def test_write_kv_matches_reference():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    kv = torch.randn(5, 2 * 2 * 8, generator=gen)
    k, v = kv[:, :16].view(5, 2, 8), kv[:, 16:].view(5, 2, 8)  # strided views, as from qkv
    slots = torch.tensor([3, 17, 0, 23, 9])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    cpu_ops.write_kv(k, v, k_cache, v_cache, slots)
    write_kv_reference(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_write_kv_rejects_a_bad_slot_and_writes_nothing():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    k = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="slots"):
        cpu_ops.write_kv(k, k, k_cache, v_cache, torch.tensor([1, 8]))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("lens", [[1], [16], [17], [5, 33, 8], [40, 1, 24, 90]])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_decode_matches_naive_and_reference(lens, num_q_heads, num_kv_heads, block_size):
    batch = make_paged_batch(lens, num_kv_heads, 64, block_size)
    q = torch.randn(len(lens), num_q_heads, 64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 0.125)
    out = cpu_ops.paged_decode_attention(*args)
    naive = torch.cat(
        [
            naive_attention(q[b : b + 1], batch.keys[b], batch.values[b], n - 1, 0.125)
            for b, n in enumerate(lens)
        ]
    )
    assert_close(out, naive, torch.float32)
    assert_close(out, paged_decode_attention_reference(*args), torch.float32)


def test_paged_decode_reads_q_rows_from_a_wider_matrix():
    batch = make_paged_batch([7, 20], 2, 32, 8)
    wide = torch.randn(2, 6 * 32 + 100)
    q = wide[:, : 6 * 32].view(2, 6, 32)
    seq_lens = torch.tensor([7, 20], dtype=torch.int32)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 0.3)
    assert_close(
        cpu_ops.paged_decode_attention(q, *args),
        paged_decode_attention_reference(q.contiguous(), *args),
        torch.float32,
    )


def test_paged_decode_rejects_a_table_too_short_or_naming_a_missing_block():
    batch = make_paged_batch([10], 1, 16, 8, extra_blocks=0)
    q = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="block table holds"):
        cpu_ops.paged_decode_attention(
            q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            torch.tensor([17], dtype=torch.int32),
            1.0,
        )
    bad = batch.block_tables.clone()
    bad[0, 1] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="blocks must lie"):
        cpu_ops.paged_decode_attention(
            q, batch.k_cache, batch.v_cache, bad, torch.tensor([10], dtype=torch.int32), 1.0
        )


@pytest.mark.parametrize("rows", [1, 4, 40])
def test_silu_mul_matches_torch(rows):
    gate_up = torch.randn(rows, 2 * 48) * 4
    gate, up = gate_up.split(48, dim=-1)
    torch.testing.assert_close(
        cpu_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("path", list(ALL_FLAGS))
def test_silu_mul_on_every_path_matches_float64(path, monkeypatch):
    # 53 columns: the AVX-512 loop, AVX2's, and the scalar tail of each; gates far past the
    # exponential's clamp on both sides, and exact zeros
    lib = cpu_ops.build(ALL_FLAGS[path])
    monkeypatch.setattr(cpu_ops, "build", lambda: lib)
    gen = torch.Generator().manual_seed(5)
    gate = torch.randn(3, 53, generator=gen) * torch.tensor([1.0, 8.0, 60.0]).unsqueeze(1)
    gate[0, :4] = torch.tensor([0.0, -0.0, 120.0, -120.0])
    up = torch.randn(3, 53, generator=gen)
    out = cpu_ops.silu_mul(torch.cat([gate, up], dim=1))
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    torch.testing.assert_close(out.double(), ref, atol=1e-30, rtol=3e-7)


@pytest.mark.parametrize(
    ("prefixes", "news"), [([0], [5]), ([16, 3], [4, 1]), ([40, 7, 0], [9, 2, 3])]
)
def test_extend_rows_match_naive_causal_attention(prefixes, news):
    # each extend sequence's K/V (prefix and new tokens) is already in the cache, as after write_kv
    lens = [p + n for p, n in zip(prefixes, news, strict=True)]
    batch = make_paged_batch(lens, 2, 32, 8)
    q = torch.randn(sum(news) + 1, 6, 32)  # one leading row the call must leave alone
    row_seqs = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(news)).int()
    row_lens = torch.cat(
        [torch.arange(p + 1, p + n + 1) for p, n in zip(prefixes, news, strict=True)]
    ).int()
    row_ids = torch.arange(1, sum(news) + 1)
    out = torch.full_like(q, 7.0)
    cpu_ops.paged_attention_rows(
        q, batch.k_cache, batch.v_cache, batch.block_tables, row_ids, row_seqs, row_lens, 0.2, out
    )
    assert torch.equal(out[0], torch.full_like(out[0], 7.0))
    start = 1
    for b, (p, n) in enumerate(zip(prefixes, news, strict=True)):
        expected = naive_attention(q[start : start + n], batch.keys[b], batch.values[b], p, 0.2)
        assert_close(out[start : start + n], expected, torch.float32)
        start += n


@pytest.mark.parametrize("num_bytes", [0, 7, 8, 8 * 4096 + 24, 3 * 8 * 4096])
def test_stream_sum_adds_every_whole_word_once(num_bytes):
    from prefixrag.kernels.cpu_ops import stream_sum

    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    words = data[: num_bytes // 8 * 8].view(torch.int64).tolist()
    expected = sum(w % 2**64 for w in words) % 2**64  # unsigned words, wrapping as C adds
    assert stream_sum(data) == expected
