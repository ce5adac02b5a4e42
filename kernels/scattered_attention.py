"""Scattered-query attention: queries at arbitrary positions of one sequence attend causally to its
paged KV cache (CacheBlend-style selective recompute, where only some tokens are recomputed).

Every K/V of the sequence, the recomputed tokens' fresh ones included, is already in the cache, so
query i simply sees cache positions 0..q_positions[i] through the sequence's block table. With
q_positions = prefix_len..prefix_len+n-1 this is exactly an extend (prefix prefill).
"""

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


def _check_scattered_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_positions: torch.Tensor,
) -> int:
    """Validate shapes and dtypes; return the GQA group size."""
    check_rank("q", q, 3)
    check_float("q", q)
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    check_index("block_table", block_table)
    check_index("q_positions", q_positions)
    if q_positions.shape[0] != q.shape[0]:
        raise ValueError(f"q_positions has {q_positions.shape[0]} entries for {q.shape[0]} queries")
    check_same_device(q=q, k_cache=k_cache, block_table=block_table, q_positions=q_positions)
    return check_gqa(q.shape[1], num_kv_heads)


def _check_positions(
    q_positions: torch.Tensor, block_table: torch.Tensor, block_size: int, kv_len: int | None
) -> int:
    """Return kv_len (max position + 1), checking it fits the table.

    Without ``kv_len`` the positions are read back to the host (one sync) and checked for
    range; with it, the caller vouches that every position is in [0, kv_len) and only the host
    int is checked, so nothing waits on the device.
    """
    capacity = block_table.shape[0] * block_size
    if kv_len is None:
        if q_positions.numel() == 0:
            return 0
        lo, hi = (int(x) for x in torch.aminmax(q_positions))
        if lo < 0:
            raise ValueError(f"q_positions must be >= 0, got {lo}")
        kv_len = hi + 1
    if kv_len > capacity:
        raise ValueError(
            f"block_table holds {block_table.shape[0]} blocks of {block_size} tokens, "
            f"too few for position {kv_len - 1}"
        )
    return kv_len


def scattered_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch: query i attends to cache positions 0..q_positions[i] of one sequence.

    q [N, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_table [num_seq_blocks];
    q_positions [N], in any order, repeats allowed. Returns [N, Hq, D] in q's dtype, computed in
    fp32. Works for any block size.
    """
    _check_scattered_args(q, k_cache, v_cache, block_table, q_positions)
    kv_len = _check_positions(q_positions, block_table, k_cache.shape[1], None)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    k, v = gather_kv(k_cache, v_cache, block_table.unsqueeze(0), kv_len)
    is_visible = torch.arange(kv_len, device=q.device) <= q_positions.unsqueeze(1)  # [N, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),  # [Hq, N, D]
        k[0].transpose(0, 1).float(),  # [Hkv, L, D]
        v[0].transpose(0, 1).float(),
        attn_mask=is_visible,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).to(q.dtype)


_LOG2E = 1.4426950408889634


@triton.jit
def _scattered_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    q_positions_ptr,
    out_ptr,
    qk_scale,
    num_queries,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
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
    kv_head = head // group

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    is_row = offs_m < num_queries
    rows = offs_m.to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=is_row[:, None],
        other=0.0,
    )
    # Padding rows take position 0: key 0 is then visible to every row, so no row's running max
    # stays -inf (which would turn exp2(-inf - -inf) into NaN).
    query_pos = tl.load(q_positions_ptr + offs_m, mask=is_row, other=0).to(tl.int32)
    # The tile only needs keys up to its own furthest query; sorted positions keep this tight.
    end = tl.max(query_pos, axis=0) + 1

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile_start in range(0, end, BLOCK_N):
        offs_pos = tile_start + offs_n
        is_key = offs_pos < end
        block_ids = tl.load(block_table_ptr + offs_pos // block_size, mask=is_key, other=0)
        offs_kv = (
            block_ids.to(tl.int64)[:, None] * stride_cb
            + (offs_pos % block_size)[:, None] * stride_cs
            + kv_head * stride_ch
            + offs_d[None, :]
        )
        k = tl.load(k_cache_ptr + offs_kv, mask=is_key[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs_kv, mask=is_key[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        # offs_pos <= query_pos < end, so the causal test also hides keys past the tile's end.
        is_visible = offs_pos[None, :] <= query_pos[:, None]
        scores = tl.where(is_visible, scores, float("-inf"))
        m_new = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp2(row_max - m_new)
        p = tl.exp2(scores - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = m_new

    o = acc / row_sum[:, None]
    offs_o = rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptr + offs_o, o.to(out_ptr.dtype.element_ty), mask=is_row[:, None])


def scattered_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    kv_len: int | None = None,
) -> torch.Tensor:
    """Triton: the attention of :func:`scattered_attention_reference`.

    One program per (tile of queries, query head) streams the sequence's keys from position 0 to
    the tile's largest query position with an online softmax, masking per query position. Any
    order works; ascending positions make each tile stop sooner.

    Positions are range-checked on the host, one device sync. A caller that knows
    ``kv_len`` (max position + 1, e.g. :class:`ScatteredMetadata`) passes it to skip that sync;
    the positions are then trusted to lie in [0, kv_len), which is not checked on the device.
    """
    _check_scattered_args(q, k_cache, v_cache, block_table, q_positions)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_head_dim(head_dim)
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the cache dtype {k_cache.dtype}")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    # The kernel indexes both 1-D tensors with unit stride.
    block_table = block_table.contiguous()
    q_positions = q_positions.contiguous()
    _check_positions(q_positions, block_table, block_size, kv_len)
    num_queries, num_q_heads, _ = q.shape
    out = torch.empty_like(q)
    if num_queries == 0:
        return out
    on_gpu = q.device.type == "cuda"
    # tl.dot needs at least 16 rows; the interpreter pays per element, so keep CPU tiles small.
    block_m = 64 if on_gpu else 16
    grid = (triton.cdiv(num_queries, block_m), num_q_heads)
    _scattered_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        q_positions,
        out,
        scale * _LOG2E,
        num_queries,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_size,
        num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=64 if on_gpu else 16,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=2,
    )
    return out
