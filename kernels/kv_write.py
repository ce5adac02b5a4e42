"""Scatter the new tokens' K and V into their paged-cache slots.

slot = block_id * block_size + offset; slot -1 marks a padding token, which is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixrag.kernels._checks import (
    check_float,
    check_index,
    check_kv_cache,
    check_rank,
    check_same_device,
)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        block_id = slot // block_size
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        src_k = k_ptr + tok.to(tl.int64) * stride_kt + head * stride_kh + offs_d
        src_v = v_ptr + tok.to(tl.int64) * stride_vt + head * stride_vh + offs_d
        dst = block_id * stride_cb + (slot % block_size) * stride_cs + head * stride_ch + offs_d
        k = tl.load(src_k, mask=mask_d)
        v = tl.load(src_v, mask=mask_d)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask_d)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask_d)


def _check_write_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_rank("k", k, 3)
    check_float("k", k)
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)}")
    if tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k is [T, {k.shape[1]}, {k.shape[2]}] but the cache holds "
            f"{num_kv_heads} heads of dim {head_dim}"
        )
    check_index("slot_mapping", slot_mapping)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton: write k[t], v[t] ([T, Hkv, D]) into cache slot slot_mapping[t]; skip slot -1.

    Caches are [num_blocks, block_size, Hkv, D] with a contiguous last dim. Slots must be in range;
    this launch does not check them on the device (the reference does).
    """
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    num_tokens, num_kv_heads, head_dim = k.shape
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain torch: the scatter of :func:`write_kv`; raises ValueError on out-of-range slots."""
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    num_blocks, block_size = k_cache.shape[:2]
    is_real = slot_mapping >= 0
    slots = slot_mapping[is_real].long()
    if slots.numel() == 0:
        return
    if int(slots.max()) >= num_blocks * block_size or int(slot_mapping.min()) < -1:
        raise ValueError(f"slot_mapping has slots outside [-1, {num_blocks * block_size})")
    block_ids, offs_in_block = slots // block_size, slots % block_size
    k_cache[block_ids, offs_in_block] = k[is_real].to(k_cache.dtype)
    v_cache[block_ids, offs_in_block] = v[is_real].to(v_cache.dtype)
