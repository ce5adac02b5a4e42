"""Paged decode attention: one new query token per sequence against its whole cached context, read
through the block table; grouped-query heads share each KV tile."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._checks import (
    check_float,
    check_gqa,
    check_index,
    check_kv_cache,
    check_rank,
    check_same_device,
)
from kernels._paged import gather_kv


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
