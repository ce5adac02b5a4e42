"""Attention for queries at scattered positions of one sequence (CacheBlend-style selective
recompute): the chosen tokens' fresh K/V go into the paged cache, then each of them attends
causally to every cached position up to its own.

Mirrors :class:`AttentionBackend` (same ``forward``), with :class:`ScatteredMetadata` instead of
:class:`AttentionMetadata`:

- ``sdpa``: gathers the sequence's blocks once per layer and runs SDPA over groups of query rows,
  each over the keys up to its furthest position, under float masks built once per step (CPU,
  any dtype);
- ``triton``: the kernel of kernels/scattered_attention;
- ``reference``: that kernel's plain-torch reference (slow, for checking).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefixrag.engine.attention.backend import FusedOps
from prefixrag.engine.attention.factory import BACKENDS
from prefixrag.engine.attention.sdpa import sdpa_gqa

IMPLS = ("sdpa", "triton", "reference")


@dataclass(slots=True)
class ScatteredMetadata:
    """Index tensors for one step of one sequence, shared by every layer."""

    slot_mapping: torch.Tensor  # int64 [N]: cache slot of each query's own fresh K/V
    q_positions: torch.Tensor  # int64 [N]
    block_table: torch.Tensor  # int32 [nb]: the sequence's blocks
    kv_len: int  # max position + 1: how much of the sequence any query sees
    scale: float
    plan: Any = None  # implementation-private precomputation, filled on first use


def build_scattered_metadata(
    positions: Sequence[int],
    block_ids: Sequence[int],
    *,
    block_size: int,
    scale: float,
    device: torch.device | str,
) -> ScatteredMetadata:
    """Metadata for queries at ``positions`` of the sequence stored in ``block_ids``.

    Raises ValueError on a negative or repeated position (two fresh K/V for one slot would race
    in the write), or when the blocks cannot hold the largest position.
    """
    positions = list(positions)
    if positions and min(positions) < 0:
        raise ValueError(f"positions must be >= 0, got {min(positions)}")
    if len(set(positions)) != len(positions):
        raise ValueError("positions must be distinct: each token has one fresh K/V")
    kv_len = max(positions, default=-1) + 1
    num_needed = -(-kv_len // block_size)
    if len(block_ids) < num_needed:
        raise ValueError(
            f"position {kv_len - 1} needs {num_needed} blocks of {block_size}, got {len(block_ids)}"
        )
    if any(b < 0 for b in block_ids[:num_needed]):
        raise ValueError(f"block_ids must be >= 0 where positions use them, got {block_ids}")
    slots = [block_ids[p // block_size] * block_size + p % block_size for p in positions]
    return ScatteredMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        q_positions=torch.tensor(positions, dtype=torch.int64, device=device),
        block_table=torch.tensor(list(block_ids), dtype=torch.int32, device=device),
        kv_len=kv_len,
        scale=scale,
    )


# Query rows per SDPA call. Each group reads keys only up to its own furthest position: the
# queries come in position order, so the early groups skip most of the masked-out keys (about a
# third less work than one call over kv_len, measured at 225 queries over 815 positions).
ROW_GROUP = 64


@dataclass(slots=True)
class _SdpaPlan:
    blocks: torch.Tensor  # int64 [ceil(kv_len / block_size)]: the blocks any query reads
    # per group of query rows: (first row, end row, keys it reads, its additive mask [rows, keys]
    # with 0 where visible and -inf past each query's position)
    groups: list[tuple[int, int, int, torch.Tensor]]


class ScatteredAttention:
    """Writes the queries' fresh K/V into the cache, then attends (see the module docstring)."""

    fused_ops: FusedOps | None = None

    def __init__(self, impl: str = "sdpa") -> None:
        if impl not in IMPLS:
            raise ValueError(f"unknown scattered attention impl {impl!r}; choose from {IMPLS}")
        self.impl = impl
        self._kernel = None
        if impl != "sdpa":
            # Imported here, not at module level: triton.jit picks compiled or interpreted code
            # at import time, and the sdpa path must not import kernels/ at all.
            from prefixrag.kernels import scattered_attention as kernels

            if impl == "triton":
                self._kernel = kernels.scattered_attention
            else:
                self._kernel = kernels.scattered_attention_reference

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: ScatteredMetadata,
    ) -> torch.Tensor:
        """q [N, Hq, D], k and v [N, Hkv, D] -> [N, Hq, D]; row i is at meta.q_positions[i]."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        if q.shape[0] == 0:
            return q.new_empty(q.shape)
        if self.impl == "triton":
            return self._kernel(
                q,
                k_cache,
                v_cache,
                meta.block_table,
                meta.q_positions,
                meta.scale,
                kv_len=meta.kv_len,
            )
        if self.impl == "reference":
            return self._kernel(q, k_cache, v_cache, meta.block_table, meta.q_positions, meta.scale)
        return self._sdpa(q, k_cache, v_cache, meta)

    @staticmethod
    def _sdpa(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: ScatteredMetadata
    ) -> torch.Tensor:
        if meta.plan is None:
            meta.plan = _sdpa_plan(meta, k_cache.shape[1], q.dtype)
        plan: _SdpaPlan = meta.plan
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        # Whole blocks through index_select: one contiguous copy per block, where a per-slot
        # gather (or advanced indexing) is far slower on CPU. Each layer has its own cache, so
        # this copy is per layer; only the block list and the mask are shared.
        # (a 16-bit cache under a float32 model is widened: SDPA runs in q's dtype)
        k_seq = k_cache.index_select(0, plan.blocks).view(-1, num_kv_heads, head_dim).to(q.dtype)
        v_seq = v_cache.index_select(0, plan.blocks).view(-1, num_kv_heads, head_dim).to(q.dtype)
        q_heads = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, N, D]
        k_heads = k_seq.transpose(0, 1).unsqueeze(0)  # [1, Hkv, slots, D]
        v_heads = v_seq.transpose(0, 1).unsqueeze(0)
        out = q.new_empty(q.shape)
        for start, end, keys, mask in plan.groups:
            o = sdpa_gqa(
                q_heads[:, :, start:end],
                k_heads[:, :, :keys],
                v_heads[:, :, :keys],
                scale=meta.scale,
                attn_mask=mask,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out


def _sdpa_plan(meta: ScatteredMetadata, block_size: int, dtype: torch.dtype) -> _SdpaPlan:
    # A float mask, built once per step in q's dtype: SDPA would convert a boolean one into an
    # additive one again in every layer.
    device = meta.q_positions.device
    num_blocks = -(-meta.kv_len // block_size)
    blocks = meta.block_table[:num_blocks].long()
    positions = meta.q_positions.tolist()
    groups = []
    for start in range(0, len(positions), ROW_GROUP):
        end = min(start + ROW_GROUP, len(positions))
        keys = max(positions[start:end]) + 1
        visible = torch.arange(keys, device=device) <= meta.q_positions[start:end].unsqueeze(1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        groups.append((start, end, keys, mask.masked_fill_(~visible, float("-inf"))))
    return _SdpaPlan(blocks, groups)


def make_scattered_attention(
    main_backend_name: str, device: torch.device | str
) -> ScatteredAttention:
    """The scattered path to pair with the engine's attention backend ``main_backend_name``.

    ``triton`` on CUDA, ``sdpa`` elsewhere; a ``reference`` main backend (a checking run) gets the
    plain-torch reference, and a ``torch`` one (no kernels wanted) gets ``sdpa`` on CUDA too.
    """
    if main_backend_name not in BACKENDS:
        raise ValueError(f"unknown attention backend {main_backend_name!r}; choose from {BACKENDS}")
    if main_backend_name == "reference":
        return ScatteredAttention("reference")
    if torch.device(device).type == "cuda" and main_backend_name != "torch":
        return ScatteredAttention("triton")
    return ScatteredAttention("sdpa")
