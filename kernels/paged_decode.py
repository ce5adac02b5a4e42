"""Paged decode attention: one new query token per sequence against its whole cached context, read
through the block table; grouped-query heads share each KV tile."""

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


def _check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> int:
    """Validate shapes and dtypes; return the GQA group size."""
    check_rank("q", q, 3)
    check_float("q", q)
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    check_index("block_tables", block_tables, rank=2)
    check_index("seq_lens", seq_lens)
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(
            f"batch mismatch: q {q.shape[0]}, block_tables {block_tables.shape[0]}, "
            f"seq_lens {seq_lens.shape[0]}"
        )
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, seq_lens=seq_lens)
    return check_gqa(q.shape[1], num_kv_heads)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch: softmax(q K^T * scale) V over each sequence's first seq_lens[b] cached tokens.

    q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks];
    seq_lens [B] >= 1 (the new token is already in the cache). Returns [B, Hq, D] in q's dtype,
    computed in fp32. Works for any block size.
    """
    group = _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens)
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return q.new_empty(q.shape)
    if int(seq_lens.min()) < 1:
        raise ValueError("seq_lens must be >= 1: the new token is part of the context")
    max_len = int(seq_lens.max())
    k, v = gather_kv(k_cache, v_cache, block_tables, max_len)
    num_kv_heads = k.shape[2]
    # GQA: the group's query heads become the "query length" axis, so K/V are never repeated.
    q_grouped = q.reshape(batch, num_kv_heads, group, head_dim).float()
    k = k.transpose(1, 2).float()  # [B, Hkv, L, D]
    v = v.transpose(1, 2).float()
    is_valid = torch.arange(max_len, device=q.device) < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q_grouped, k, v, attn_mask=is_valid[:, None, None, :], scale=scale
    )
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


# NOTE: exp2 with log2(e) folded into the scale is cheaper than exp on GPUs; results are identical
# up to rounding.
_LOG2E = 1.4426950408889634
# Splits of fewer tokens than this cost more in the reduction than they gain in parallelism.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
# Programs per SM that a split count aims for. On an H200 (bench/kernels_bench.py --sweep-decode,
# Llama-8B heads, bf16) two per SM left the last wave part-empty: 8k x 8 sequences ran at 64% of
# peak with 5 splits and 69% with 8; 32k x 2 at 59% with 17 and 64% with 64.
_PROGRAMS_PER_SM = 4


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    block_size,
    group,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each split takes an equal, tile-aligned share of this sequence's own context.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    is_head = offs_g < group
    heads = kv_head * group + offs_g
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=is_head[:, None],
        other=0.0,
    )

    row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
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
        scores = tl.where(is_key[None, :], scores, float("-inf"))
        m_new = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp2(row_max - m_new)
        p = tl.exp2(scores - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = m_new

    out_rows = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
    if IS_SPLIT:
        # An empty split (past the end of a short sequence) leaves lse -inf and weighs nothing.
        is_empty = row_sum == 0.0
        lse = tl.where(is_empty, float("-inf"), row_max + tl.log2(tl.where(is_empty, 1.0, row_sum)))
        o = acc / tl.where(is_empty, 1.0, row_sum)[:, None]
        tl.store(out_rows + split * stride_os + offs_d[None, :], o, mask=is_head[:, None])
        lse_offs = seq.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(lse_ptr + lse_offs, lse, mask=is_head)
    else:
        o = acc / row_sum[:, None]
        tl.store(out_rows + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=is_head[:, None])


@triton.jit
def _paged_decode_reduce_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    is_split = offs_s < num_splits
    lse = tl.load(
        lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=is_split, other=float("-inf")
    )
    # Split 0 always holds the first token, so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    partial = tl.load(
        partial_ptr
        + seq * stride_pb
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=is_split[:, None],
        other=0.0,
    )
    o = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def _pick_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    # Enough (sequence, kv head, split) programs for _PROGRAMS_PER_SM on every SM, but no split
    # shorter than _MIN_TOKENS_PER_SPLIT. Sized from the table's capacity so no host sync is needed.
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, batch * num_kv_heads)
    affordable = triton.cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, affordable, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton: the attention of :func:`paged_decode_attention_reference`, flash-decoding style.

    Each (sequence, KV head) program loads every KV tile once for its whole query-head group.
    Long contexts are cut into ``num_splits`` pieces (chosen from batch and table size when None)
    whose partial results a second kernel merges by their log-sum-exp. seq_lens must be >= 1 and
    the block table must cover them; neither is checked on the device. ``num_warps``,
    ``num_stages`` and ``block_n`` (positions per tile) override the launch defaults (for
    tuning, bench/kernels_bench.py).
    """
    group = _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_head_dim(head_dim)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    for name, t in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    batch, num_q_heads, _ = q.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = _pick_num_splits(batch, num_kv_heads, max_context, q.device)
    is_split = num_splits > 1
    if is_split:
        partial = torch.empty(
            batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        dest = partial
    else:
        lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
        dest = out.unsqueeze(2)
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        dest,
        lse,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        dest.stride(0),
        dest.stride(1),
        dest.stride(2),
        lse.stride(0),
        lse.stride(1),
        block_size,
        group,
        num_splits,
        HEAD_DIM=head_dim,
        # tl.dot needs at least 16 rows; padding rows are masked.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n or (64 if q.device.type == "cuda" else 16),
        IS_SPLIT=is_split,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v},
    )
    if is_split:
        _paged_decode_reduce_kernel[(batch, num_q_heads)](
            partial,
            lse,
            out,
            partial.stride(0),
            partial.stride(1),
            partial.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out
