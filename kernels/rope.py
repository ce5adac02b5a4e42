"""Rotary position embedding (Hugging Face rotate-half layout) applied to q and k in place, and the
cos/sin table it reads (with Llama-3 and linear context scaling)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from prefixrag.kernels._checks import check_float, check_index, check_rank, check_same_device


def build_cos_sin_cache(
    head_dim: int,
    max_pos: int,
    theta: float,
    scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Return [max_pos, head_dim] = cat(cos, sin) of position * inv_freq, each half head_dim wide.

    ``scaling`` follows Hugging Face's ``rope_scaling``: None/"default", "linear" (``factor``) or
    "llama3" (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``).
    """
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= 2, got {head_dim}")
    if max_pos < 1 or theta <= 0:
        raise ValueError(f"need max_pos >= 1 and theta > 0, got {max_pos}, {theta}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    inv_freq = _scale_inv_freq(inv_freq, scaling)
    positions = torch.arange(max_pos, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    factor = float(scaling["factor"])  # type: ignore[index]
    if factor <= 0:
        raise ValueError(f"rope scaling factor must be > 0, got {factor}")
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, factor, scaling)  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope scaling type {kind!r} (known: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, scaling: dict) -> torch.Tensor:
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band in
    # between blends the two so the spectrum stays smooth.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    if high <= low:
        raise ValueError(f"llama3 rope needs high_freq_factor > low_freq_factor, got {high}, {low}")
    wavelen = 2 * math.pi / inv_freq
    blend = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def _check_rope_args(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    check_rank("q", q, 3)
    check_rank("k", k, 3)
    check_float("q", q)
    check_float("k", k)
    check_index("positions", positions)
    check_rank("cos_sin_cache", cos_sin_cache, 2)
    check_float("cos_sin_cache", cos_sin_cache)
    head_dim = q.shape[2]
    if k.shape[2] != head_dim or cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(
            f"head dims must agree and be even: q {head_dim}, k {k.shape[2]}, "
            f"cos_sin_cache {cos_sin_cache.shape[1]}"
        )
    if k.shape[0] != q.shape[0] or positions.shape[0] != q.shape[0]:
        raise ValueError(
            f"token counts differ: q {q.shape[0]}, k {k.shape[0]}, positions {positions.shape[0]}"
        )
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    # float() is a no-op view for fp32 input, so build both halves before writing either.
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x.copy_(rotated)


def apply_rope_reference_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Plain torch: rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos_sin_cache[positions],
    rotate-half convention (out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin), computed in fp32."""
    _check_rope_args(q, k, positions, cos_sin_cache)
    if positions.numel() and (
        int(positions.min()) < 0 or int(positions.max()) >= cos_sin_cache.shape[0]
    ):
        raise ValueError(f"positions must lie in [0, {cos_sin_cache.shape[0]})")
    half = q.shape[2] // 2
    cos_sin = cos_sin_cache[positions.long()].float()[:, None, :]  # [T, 1, D]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    _rotate_(q, cos, sin)
    _rotate_(k, cos, sin)


@triton.jit
def _rotate_heads(
    x_ptr,
    row,
    stride_t,
    stride_h,
    num_heads,
    half,
    cos,
    sin,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_HEADS)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < half)[None, :]
    first = x_ptr + row * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    half,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    is_col = offs_d < half
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=is_col, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + half + offs_d, mask=is_col, other=0.0)
    cos, sin = cos[None, :], sin.to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr, row, stride_qt, stride_qh, num_q_heads, half, cos, sin, BLOCK_Q_HEADS, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr, row, stride_kt, stride_kh, num_kv_heads, half, cos, sin, BLOCK_KV_HEADS, BLOCK_HALF
    )


def apply_rope_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Triton: rotate q [T, Hq, D] and k [T, Hkv, D] in place, as :func:`apply_rope_reference_`.

    One program per token rotates all its heads. Positions must index cos_sin_cache; that is not
    checked on the device.
    """
    _check_rope_args(q, k, positions, cos_sin_cache)
    if any(t.stride(-1) != 1 for t in (q, k, cos_sin_cache)):
        raise ValueError("q, k and cos_sin_cache must be contiguous in their last dim")
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        k.shape[1],
        half,
        BLOCK_Q_HEADS=triton.next_power_of_2(num_q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
