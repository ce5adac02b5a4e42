"""Input checks shared by the kernel wrappers: each raises ValueError with a message that names the
argument, so a bad call fails before launch instead of reading out of bounds on the device."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_rank(name: str, t: torch.Tensor, rank: int) -> None:
    """Raise unless ``t`` has exactly ``rank`` dimensions."""
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got shape {tuple(t.shape)}")


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise unless ``t`` is fp32, fp16 or bf16."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, rank: int = 1) -> None:
    """Raise unless ``t`` is an int32/int64 tensor of the given rank."""
    check_rank(name, t, rank)
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise unless every tensor lives on the same device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a paged KV pair and return (num_blocks, block_size, num_kv_heads, head_dim)."""
    check_rank("k_cache", k_cache, 4)
    check_float("k_cache", k_cache)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)}/{v_cache.dtype} must match "
            f"k_cache {tuple(k_cache.shape)}/{k_cache.dtype}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"k_cache has an empty dimension: {tuple(k_cache.shape)}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """Return the group size (query heads per KV head); raise if it is not a whole number."""
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def check_head_dim(head_dim: int) -> None:
    """Triton tiles the head dimension in one block, so it must be a power of two."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"Triton kernels need a power-of-two head_dim >= 16, got {head_dim}")
