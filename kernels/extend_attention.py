"""Prefix-prefill (extend) attention: packed new tokens of several sequences attend fully to their
cached prefix and causally to each other, all K/V read through the block table."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from prefixrag.kernels._checks import (
    check_float,
    check_gqa,
    check_head_dim,
    check_index,
    check_kv_cache,
    check_rank,
    check_same_device,
)
from prefixrag.kernels._paged import gather_kv
from prefixrag.kernels._precision import dot_precision


def _check_extend_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    cu_extend: torch.Tensor,
) -> int:
    """Validate shapes and dtypes; return the GQA group size."""
    check_rank("q", q, 3)
    check_float("q", q)
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    check_index("block_tables", block_tables, rank=2)
    check_index("prefix_lens", prefix_lens)
    check_index("extend_lens", extend_lens)
    check_index("cu_extend", cu_extend)
    batch = block_tables.shape[0]
    if prefix_lens.shape[0] != batch or extend_lens.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: block_tables {batch}, prefix_lens {prefix_lens.shape[0]}, "
            f"extend_lens {extend_lens.shape[0]}"
        )
    if cu_extend.shape[0] != batch + 1:
        raise ValueError(f"cu_extend must have B+1 = {batch + 1} entries, got {cu_extend.shape[0]}")
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, cu_extend=cu_extend)
    return check_gqa(q.shape[1], num_kv_heads)


def _check_extend_values(
    num_tokens: int, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, cu_extend: torch.Tensor
) -> None:
    """Check the lengths agree with each other and with q (needs their values on the host)."""
    if int(cu_extend[0]) != 0 or int(cu_extend[-1]) != num_tokens:
        raise ValueError(f"cu_extend must run from 0 to T={num_tokens}, got {cu_extend.tolist()}")
    if not torch.equal(cu_extend[1:] - cu_extend[:-1], extend_lens.to(cu_extend.dtype)):
        raise ValueError("cu_extend offsets must be the running sum of extend_lens")
    if prefix_lens.numel() and (int(prefix_lens.min()) < 0 or int(extend_lens.min()) < 0):
        raise ValueError("prefix_lens and extend_lens must be >= 0")


def _extend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """q [E, Hq, D] new tokens; k, v [P+E, Hkv, D] contiguous context -> [E, Hq, D] in fp32."""
    num_new, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    # GQA: fold the group into the query axis ([Hkv, G*E, D], g-major) so K/V are never repeated.
    q_folded = q.float().reshape(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q_folded = q_folded.reshape(num_kv_heads, group * num_new, head_dim)
    offs_key = torch.arange(prefix_len + num_new, device=q.device)
    offs_query = prefix_len + torch.arange(num_new, device=q.device)
    is_visible = (offs_key[None, :] <= offs_query[:, None]).repeat(group, 1)
    out = F.scaled_dot_product_attention(
        q_folded, k.transpose(0, 1).float(), v.transpose(0, 1).float(), is_visible, scale=scale
    )
    out = out.reshape(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3)
    return out.reshape(num_new, num_q_heads, head_dim)


def extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    cu_extend: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch: token i of sequence b (q row cu_extend[b] + i, absolute position
    prefix_lens[b] + i) attends to cached positions 0..prefix_lens[b] + i of that sequence.

    q [T, Hq, D]; the new tokens' K/V must already be in the cache. Returns [T, Hq, D] in q's
    dtype, computed in fp32. Works for any block size.
    """
    _check_extend_args(q, k_cache, v_cache, block_tables, prefix_lens, extend_lens, cu_extend)
    _check_extend_values(q.shape[0], prefix_lens, extend_lens, cu_extend)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    rows = zip(prefix_lens.tolist(), extend_lens.tolist(), cu_extend.tolist(), strict=False)
    for b, (prefix_len, extend_len, start) in enumerate(rows):
        if extend_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b : b + 1], prefix_len + extend_len)
        q_new = q[start : start + extend_len]
        out[start : start + extend_len] = _extend_one(q_new, k[0], v[0], prefix_len, scale)
    return out.to(q.dtype)


_LOG2E = 1.4426950408889634


@triton.jit
def _extend_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    cu_extend_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    block_size,
    group,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + seq)
    if tile_m * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + seq)
    first_row = tl.load(cu_extend_ptr + seq).to(tl.int64)
    kv_head = head // group

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    is_row = offs_m < extend_len
    offs_q = (first_row + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + offs_q, mask=is_row[:, None], other=0.0)
    query_pos = prefix_len + offs_m

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The new tokens' K/V are already in the cache, so prefix and new keys come through one table;
    # the causal mask is a no-op on the prefix, where every key precedes every query.
    end = prefix_len + tl.minimum((tile_m + 1) * BLOCK_M, extend_len)
    for tile_start in range(0, end, BLOCK_N):
        offs_pos = tile_start + offs_n
        is_key = offs_pos < end
        block_ids = tl.load(table + offs_pos // block_size, mask=is_key, other=0).to(tl.int64)
        offs_kv = (
            block_ids[:, None] * stride_cb
            + (offs_pos % block_size)[:, None] * stride_cs
            + kv_head * stride_ch
            + offs_d[None, :]
        )
        k = tl.load(k_cache_ptr + offs_kv, mask=is_key[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs_kv, mask=is_key[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        is_visible = is_key[None, :] & (offs_pos[None, :] <= query_pos[:, None])
        scores = tl.where(is_visible, scores, float("-inf"))
        # The first tile holds key 0, visible to every row, so row_max is finite from then on.
        m_new = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp2(row_max - m_new)
        p = tl.exp2(scores - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = m_new

    o = acc / row_sum[:, None]
    offs_o = (first_row + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptr + offs_o, o.to(out_ptr.dtype.element_ty), mask=is_row[:, None])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    cu_extend: torch.Tensor,
    scale: float,
    *,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Triton: the attention of :func:`extend_attention_reference` for a packed batch.

    One program per (query tile, query head, sequence) streams that sequence's prefix and new keys
    through its block table with an online softmax. The lengths must agree with each other and
    the table must cover prefix_lens + extend_lens; that is not checked on the device.

    The grid is sized by the longest extend, read from ``extend_lens`` with one device sync
    unless the caller passes it as ``max_extend_len`` (e.g. from
    :attr:`AttentionMetadata.extend_lens_host`, once per step instead of once per layer). It is
    then trusted: a smaller value leaves the tail of longer extends uncomputed.
    """
    _check_extend_args(q, k_cache, v_cache, block_tables, prefix_lens, extend_lens, cu_extend)
    _, block_size, _, head_dim = k_cache.shape
    check_head_dim(head_dim)
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    num_tokens, num_q_heads, _ = q.shape
    out = torch.empty_like(q)
    batch = block_tables.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    on_gpu = q.device.type == "cuda"
    block_m = 64 if on_gpu else 16
    # The grid covers the longest extend; tiles past a sequence's own length exit at once.
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())  # a host sync
    elif max_extend_len < 0:
        raise ValueError(f"max_extend_len must be >= 0, got {max_extend_len}")
    grid = (triton.cdiv(max_extend_len, block_m), num_q_heads, batch)
    _extend_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        prefix_lens,
        extend_lens,
        cu_extend,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        block_size,
        num_q_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=64 if on_gpu else 16,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=2,
    )
    return out
