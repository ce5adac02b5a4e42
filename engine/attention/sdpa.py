"""Extends (prefill chunks, possibly after a cached prefix) through SDPA over whole cache blocks:
the path the torch and C backends share.

A 16-bit cache under a float32 model is widened to float32 as its blocks are gathered (SDPA runs
in q's dtype), and a fresh prefill attends over its own K/V rounded to the cache's dtype, as a
later step reading them from the cache does: cached and uncached prompts see the same keys."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from prefixrag.engine.attention.metadata import AttentionMetadata

# Rows of one SDPA call: an extend after a cached prefix runs in groups of this many q rows, each
# over the keys up to its own last position, so the causal triangle's masked half is mostly
# skipped instead of computed and thrown away (a cold prefill takes SDPA's causal path instead).
ROW_GROUP = 64

# a group of an extend's q rows: first and end row (relative to the extend), how many keys they
# read, and their additive causal mask [rows, keys]
RowGroup = tuple[int, int, int, torch.Tensor]
# one extend: its q rows start:end, the cache blocks it attends over (None: no prefix, it attends
# over its own new K/V, causally) and its row groups (empty without a prefix)
ExtendEntry = tuple[int, int, torch.Tensor | None, list[RowGroup]]


def sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, **kwargs: Any
) -> torch.Tensor:
    """SDPA over [..., H, L, D] tensors where K/V may have fewer heads than q (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **kwargs)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` would give it back: rounded, in x's own dtype."""
    return x if cache_dtype == x.dtype else x.to(cache_dtype).to(x.dtype)


def plan_extends(meta: AttentionMetadata, block_size: int) -> list[ExtendEntry]:
    """Every extend of the step, in q order (after the decode rows)."""
    extends = []
    start = meta.num_decode_tokens
    for b, n in enumerate(meta.extend_lens_host):
        extends.append(extend_entry(meta, b, start, block_size))
        start += n
    return extends


def extend_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    extends: list[ExtendEntry],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Write into ``out`` the attention of each extend's q rows (see :data:`ExtendEntry`)."""
    # rows start:end of q attend over the cache blocks given (None: a fresh prefill over its
    # own new K/V), under an additive mask that hides the future and the last block's padding
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for start, end, blocks, groups in extends:
        # [T, H, D] -> [1, H, T, D]
        q_seq = q[start:end].transpose(0, 1).unsqueeze(0)
        if blocks is None:
            o = sdpa_gqa(
                q_seq,
                as_cached(k[start:end], k_cache.dtype).transpose(0, 1).unsqueeze(0),
                as_cached(v[start:end], v_cache.dtype).transpose(0, 1).unsqueeze(0),
                scale=scale,
                is_causal=True,
            )
            out[start:end] = o[0].transpose(0, 1)
            continue
        # whole blocks, as in decode: one contiguous copy each instead of one per slot
        k_seq = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim).to(q.dtype)
        v_seq = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim).to(q.dtype)
        k_heads = k_seq.transpose(0, 1).unsqueeze(0)
        v_heads = v_seq.transpose(0, 1).unsqueeze(0)
        for lo, hi, keys, mask in groups:
            o = sdpa_gqa(
                q_seq[:, :, lo:hi],
                k_heads[:, :, :keys],
                v_heads[:, :, :keys],
                scale=scale,
                attn_mask=mask,
            )
            out[start + lo : start + hi] = o[0].transpose(0, 1)


def extend_entry(meta: AttentionMetadata, b: int, start: int, block_size: int) -> ExtendEntry:
    """Extend b's SDPA entry; its q rows begin at row ``start``."""
    # its q rows, the cache blocks it attends over (None: no prefix) and its row groups'
    # additive causal masks; float masks, built once per step, because SDPA would turn a boolean
    # one into floats again in every layer
    prefix, n = meta.extend_prefix_lens_host[b], meta.extend_lens_host[b]
    if not prefix:
        return start, start + n, None, []
    device = meta.slot_mapping.device
    num_blocks = -(-(prefix + n) // block_size)
    blocks = meta.extend_block_tables[b, :num_blocks].long()
    groups = []
    for lo in range(0, n, ROW_GROUP):
        hi = min(lo + ROW_GROUP, n)
        keys = prefix + hi  # the group's last row sits at position prefix + hi - 1
        q_pos = torch.arange(prefix + lo, prefix + hi, device=device)
        visible = torch.arange(keys, device=device) <= q_pos.unsqueeze(1)
        mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
        groups.append((lo, hi, keys, mask))
    return start, start + n, blocks, groups
