"""RMSNorm fused with the residual add: s = x + residual; out = s / rms(s) * weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixrag.kernels._checks import check_float, check_rank, check_same_device


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_rank("x", x, 2)
    check_float("x", x)
    check_rank("weight", weight, 1)
    check_float("weight", weight)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} entries for hidden size {x.shape[1]}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)}/{residual.dtype} must match "
                f"x {tuple(x.shape)}/{x.dtype}"
            )
        check_same_device(x=x, weight=weight, residual=residual)
    else:
        check_same_device(x=x, weight=weight)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: return (out, s) with s = x + residual (or x) and
    out = s * rsqrt(mean(s^2) + eps) * weight, computed in fp32 and cast to x's dtype.

    x, residual [T, H]; weight [H]. Inputs are not modified.
    """
    _check_norm_args(x, weight, residual)
    if residual is None:
        s32 = x.float()
        s = x
    else:
        s32 = x.float() + residual.float()
        s = s32.to(x.dtype)
    out = s32 * torch.rsqrt(s32.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), s


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    is_col = offs_h < hidden
    s = tl.load(x_ptr + row * stride_x + offs_h, mask=is_col, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(residual_ptr + row * stride_r + offs_h, mask=is_col, other=0.0).to(tl.float32)
        tl.store(sum_ptr + row * stride_s + offs_h, s.to(sum_ptr.dtype.element_ty), mask=is_col)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + offs_h, mask=is_col, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs_h,
        (s * rstd * weight).to(out_ptr.dtype.element_ty),
        mask=is_col,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: the result of :func:`rms_norm_reference`, one row per program, the add and the
    norm fused so the sum is read once. Inputs are not modified; without residual, s is x."""
    _check_norm_args(x, weight, residual)
    rows = (x,) if residual is None else (x, residual)
    if any(t.stride(-1) != 1 for t in (*rows, weight)):
        raise ValueError("x, residual and weight must be contiguous in their last dim")
    num_rows, hidden = x.shape
    out = torch.empty_like(x)
    s = x if residual is None else torch.empty_like(x)
    if num_rows == 0:
        return out, s
    block_h = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        s,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        s.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        num_warps=min(max(block_h // 256, 1), 16),
    )
    return out, s
