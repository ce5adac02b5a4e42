"""The torch backend: plain torch and SDPA over the paged cache, for any dtype on CPU (the cache
may be 16-bit under a float32 model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixrag.engine.attention.backend import FusedOps
from prefixrag.engine.attention.metadata import AttentionMetadata
from prefixrag.engine.attention.sdpa import ExtendEntry, extend_sdpa, plan_extends


@dataclass(slots=True)
class _TorchPlan:
    decode_blocks: torch.Tensor | None  # int64 [Bd, max_blocks]: block table, padded with block 0
    decode_mask: torch.Tensor | None  # bool [Bd, 1, 1, max_blocks * bs]; None when none is padded
    extends: list[ExtendEntry]


class TorchAttention:
    """The CPU path: gathers each sequence's cached K/V by slot once per step and runs SDPA.

    A prefill with an empty prefix attends over its own new K/V directly, without a gather.
    """

    fused_ops: FusedOps | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """See :class:`AttentionBackend`."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        if meta.plan is None:
            meta.plan = _torch_plan(meta, k_cache.shape[1])
        plan: _TorchPlan = meta.plan
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return _decode_sdpa(q, k_cache, v_cache, plan, meta.scale)
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = _decode_sdpa(q[:num_decode], k_cache, v_cache, plan, meta.scale)
        extend_sdpa(q, k, v, k_cache, v_cache, plan.extends, meta.scale, out)
        return out


def _decode_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _TorchPlan, scale: float
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # One new query per sequence: fold each KV head's query group into the query-length axis,
    # so plain SDPA does GQA without repeating K/V. q: [B, Hkv, group, D]; k, v: [B, Hkv, L, D].
    q_g = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # Gather whole blocks (one contiguous copy each), not single slots: a block-sized index list
    # is ~block_size times shorter. index_select, not k_cache[blocks]: advanced indexing is
    # orders of magnitude slower on CPU. Positions past a sequence's length are masked.
    blocks = plan.decode_blocks.view(-1)
    # A 16-bit cache under a float32 model is widened here: SDPA runs in q's dtype.
    k_seq = k_cache.index_select(0, blocks).to(q.dtype)
    v_seq = v_cache.index_select(0, blocks).to(q.dtype)
    k_seq = k_seq.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    v_seq = v_seq.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q_g, k_seq, v_seq, attn_mask=plan.decode_mask, scale=scale)
    return o.reshape(batch, num_heads, head_dim)


def _torch_plan(meta: AttentionMetadata, block_size: int) -> _TorchPlan:
    device = meta.slot_mapping.device
    decode_blocks = decode_mask = None
    if meta.num_decode_tokens:
        lens = meta.decode_seq_lens_host
        num_blocks = -(-max(lens) // block_size)
        decode_blocks = meta.decode_block_tables[:, :num_blocks].long().clamp_min(0)
        width = num_blocks * block_size
        if min(lens) != width:
            pos = torch.arange(width, device=device)
            decode_mask = (pos < meta.decode_seq_lens.unsqueeze(1)).view(len(lens), 1, 1, width)
    return _TorchPlan(decode_blocks, decode_mask, plan_extends(meta, block_size))
