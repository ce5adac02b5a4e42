"""The torch references the block-quant kernels are checked against: the dequantized matrix,
``x @ W.T`` through it, and the int8-activation product in float64 from exact block sums.

They live apart from the kernels because they read a K-quant weight through
kernels/gguf_planes.py, an independent numpy reading of the same bytes, which itself builds on
the kernels' weight type.
"""

from __future__ import annotations

import torch

from prefixrag.kernels.block_quant_matmul import (
    KQUANT_GGUF_TYPES,
    QBLOCK,
    QK_K,
    SCALE_BLOCK,
    BlockQuantWeight,
)
from prefixrag.kernels.gguf_planes import from_gguf_blocks


def as_planes(w: BlockQuantWeight) -> BlockQuantWeight:
    """A K-quant weight as the planes it stands for (kernels/gguf_planes.py, in numpy: an
    independent reading of the same bytes); any other weight as it is."""
    if not w.is_kquant:
        return w
    return from_gguf_blocks(w.codes.numpy(), KQUANT_GGUF_TYPES[w.kind], tuple(w.shape))


def dequantize_torch(w: BlockQuantWeight) -> torch.Tensor:
    """The float32 matrix [N, K] in torch (the reference)."""
    w = as_planes(w)
    n, k = w.shape
    d = w.d.repeat_interleave(SCALE_BLOCK[w.kind], dim=1)
    if w.kind == "q8m":
        return torch.addcmul(w.m.repeat_interleave(QBLOCK, dim=1), d, w.codes.float())  # type: ignore[union-attr]
    if w.kind != "q4":
        return w.codes.float() * d
    blocks = w.codes.reshape(n, k // QBLOCK, QBLOCK // 2)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(n, k).float()
    return torch.addcmul(w.m.repeat_interleave(QBLOCK, dim=1), d, codes)  # type: ignore[union-attr]


def block_quant_matmul_torch(x: torch.Tensor, w: BlockQuantWeight) -> torch.Tensor:
    """``x @ W.T`` through the dequantized matrix (the reference)."""
    return x.float() @ dequantize_torch(w).T


def quantize_activations_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] to (int8 codes [M, K], float32 scales [M, K/32]): per block of 32,
    dx = max|x| / 127 and code = round-half-even(x * (127 / max|x|)); 0 for an all-zero block."""
    blocks = x.float().reshape(x.shape[0], -1, QBLOCK)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None]).to(torch.int8)
    return codes.reshape(x.shape), amax / 127.0


def block_quant_matmul_q8a_torch(x: torch.Tensor, w: BlockQuantWeight) -> torch.Tensor:
    """``x @ W.T`` with x quantized as :func:`quantize_activations_torch` does, in float64 from
    the exact integer block sums (the reference; the C kernel differs by float32 rounding). A
    K-quant W takes activations quantized per super-block instead (block_quant_matmul_q8k_torch),
    as the C kernel does."""
    if w.is_kquant:
        return block_quant_matmul_q8k_torch(x, w).float()
    w = as_planes(w)
    n, k = w.shape
    codes, dx = quantize_activations_torch(x)
    xq = codes.double().reshape(x.shape[0], 1, k // QBLOCK, QBLOCK)
    wd = dequantize_torch(w).double().reshape(1, n, k // QBLOCK, QBLOCK)
    # w = d * c + m exactly in float64 (the float32 dequantization rounds once; recover d * c + m
    # from the planes instead so the reference carries no float32 rounding of its own)
    if w.kind == "q4":
        blocks = w.codes.reshape(n, k // QBLOCK, QBLOCK // 2)
        c = torch.cat([blocks & 15, blocks >> 4], dim=-1).double()
    else:
        c = w.codes.double().reshape(n, k // QBLOCK, QBLOCK)
    d = w.d.double().repeat_interleave(SCALE_BLOCK[w.kind], dim=1).reshape(n, k // QBLOCK, QBLOCK)
    m = 0.0 if w.m is None else w.m.double()[..., None]
    wd = (d * c + m)[None]
    return ((xq * wd).sum(-1) * dx.double()[:, None, :]).sum(-1)


def quantize_activations_q8k_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] to (int8 codes [M, K], float32 scales [M, K/256]) per super-block of 256, as
    kernels/csrc/q8k_act.h quantizes a row for K-quant weights (llama.cpp's Q8_K): dx =
    max|x| / 127 and code = round-half-even(x * (127 / max|x|))."""
    blocks = x.float().reshape(x.shape[0], -1, QK_K)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None]).to(torch.int8)
    return codes.reshape(x.shape), amax / 127.0


def block_quant_matmul_q8k_torch(x: torch.Tensor, w: BlockQuantWeight) -> torch.Tensor:
    """``x @ W.T`` for a K-quant W with x quantized per super-block, in float64: the planes'
    d * c + m is exact in float64, so this is the exact sum the C kernel rounds in float32."""
    planes = as_planes(w)
    n, k = planes.shape
    codes, dx = quantize_activations_q8k_torch(x)
    if planes.kind == "q4":
        blocks = planes.codes.reshape(n, k // QBLOCK, QBLOCK // 2)
        c = torch.cat([blocks & 15, blocks >> 4], dim=-1).double().reshape(n, k)
    else:
        c = planes.codes.double()
    d = planes.d.double().repeat_interleave(SCALE_BLOCK[planes.kind], dim=1)
    wd = d * c
    if planes.m is not None:
        wd = wd + planes.m.double().repeat_interleave(QBLOCK, dim=1)
    xq = codes.double().reshape(x.shape[0], 1, k // QK_K, QK_K)
    per_super = (xq * wd.reshape(1, n, k // QK_K, QK_K)).sum(-1)
    return (per_super * dx.double()[:, None, :]).sum(-1)
