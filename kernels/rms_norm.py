"""RMSNorm fused with the residual add: s = x + residual; out = s / rms(s) * weight."""

from __future__ import annotations

import torch

from kernels._checks import check_float, check_rank, check_same_device


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
