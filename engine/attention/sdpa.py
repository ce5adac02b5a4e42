"""Extends (prefill chunks, possibly after a cached prefix) through SDPA over whole cache blocks:
the path the torch and C backends share."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from prefixrag.engine.attention.metadata import AttentionMetadata

# one extend: its q rows start:end, the cache blocks it attends over (None: no prefix, it attends
# over its own new K/V) and its additive causal mask
ExtendEntry = tuple[int, int, torch.Tensor | None, torch.Tensor | None]


def sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, **kwargs: Any
) -> torch.Tensor:
    """SDPA over [..., H, L, D] tensors where K/V may have fewer heads than q (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **kwargs)


def plan_extends(meta: AttentionMetadata, block_size: int) -> list[ExtendEntry]:
    """Every extend of the step, in q order (after the decode rows)."""
    extends = []
    start = meta.num_decode_tokens
    for b, n in enumerate(meta.extend_lens_host):
        extends.append(_extend_entry(meta, b, start, block_size))
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
    for start, end, blocks, mask in extends:
        # [T, H, D] -> [1, H, T, D]
        q_seq = q[start:end].transpose(0, 1).unsqueeze(0)
        if blocks is None:
            k_seq, v_seq = k[start:end], v[start:end]
        else:
            # whole blocks, as in decode: one contiguous copy each instead of one per slot
            k_seq = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
            v_seq = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
        o = sdpa_gqa(
            q_seq,
            k_seq.transpose(0, 1).unsqueeze(0),
            v_seq.transpose(0, 1).unsqueeze(0),
            scale=scale,
            attn_mask=mask,
            is_causal=blocks is None,
        )
        out[start:end] = o[0].transpose(0, 1)


def _extend_entry(meta: AttentionMetadata, b: int, start: int, block_size: int) -> ExtendEntry:
    # extend b's q rows, the cache blocks it attends over (None: no prefix) and its additive
    # causal mask [n, blocks * block_size]; a float mask, built once per step, because SDPA
    # would turn a boolean one into floats again in every layer
    prefix, n = meta.extend_prefix_lens_host[b], meta.extend_lens_host[b]
    if not prefix:
        return start, start + n, None, None
    device = meta.slot_mapping.device
    num_blocks = -(-(prefix + n) // block_size)
    blocks = meta.extend_block_tables[b, :num_blocks].long()
    q_pos = torch.arange(prefix, prefix + n, device=device)
    visible = torch.arange(num_blocks * block_size, device=device) <= q_pos.unsqueeze(1)
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    return start, start + n, blocks, mask
