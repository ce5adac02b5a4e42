"""Prefix-prefill (extend) attention: packed new tokens of several sequences attend fully to their
cached prefix and causally to each other, all K/V read through the block table."""

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
