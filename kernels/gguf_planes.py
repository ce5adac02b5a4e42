"""GGUF tensors as :class:`BlockQuantWeight` planes, bit for bit the matrices gguf-py dequantizes.

Q4_0, Q4_1, Q4_K become q4; Q8_0 and Q5_0 q8; Q5_1 and Q5_K q8m; Q6_K q8_16. Each conversion
says why the kernel's one rounding (an fma, or a product) equals gguf's arithmetic: every
product of an fp16 scale, a small integer scale and a code fits float32's 24-bit significand.
"""

from __future__ import annotations

import numpy as np
import torch

from prefixrag.kernels.block_quant_matmul import QBLOCK, BlockQuantWeight

# GGUF block sizes in bytes: fp16 d [, fp16 m], codes (Q5_0 and Q5_1: 32 high bits, then low
# nibbles)
_Q4_0_BYTES, _Q4_1_BYTES, _Q8_0_BYTES, _Q5_0_BYTES, _Q5_1_BYTES = 18, 20, 34, 22, 24
# Q4_K: super-blocks of 256, fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of codes;
# Q5_K: Q4_K's fields and 32 bytes of fifth bits before the codes;
# Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d
QK_K, _Q4_K_BYTES, _Q5_K_BYTES, _Q6_K_BYTES = 256, 144, 176, 210
SUPPORTED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def from_gguf_blocks(raw: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> BlockQuantWeight:
    """Split a GGUF tensor's raw blocks (uint8, any shape) of ``gguf_type`` into planes.

    ``shape`` is (N, K), rows first, as gguf's dequantizer returns the matrix.
    """
    n, k = shape
    if k % QBLOCK:
        raise ValueError(f"K = {k} is not a multiple of the block size {QBLOCK}")
    if gguf_type in ("Q4_K", "Q5_K"):
        return _from_q4_k_or_q5_k(raw, gguf_type, n, k)
    if gguf_type == "Q6_K":
        return _from_q6_k(raw, n, k)
    sizes = {
        "Q4_0": _Q4_0_BYTES, "Q4_1": _Q4_1_BYTES, "Q8_0": _Q8_0_BYTES,
        "Q5_0": _Q5_0_BYTES, "Q5_1": _Q5_1_BYTES,
    }  # fmt: skip
    size = sizes.get(gguf_type)
    if size is None:
        raise ValueError(f"{gguf_type} is not one of {', '.join(SUPPORTED_GGUF_TYPES)}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // QBLOCK, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if gguf_type in ("Q8_0", "Q5_0"):
        codes = blocks[..., 2:] if gguf_type == "Q8_0" else _q5_codes(blocks[..., 2:]) - 16
        codes = np.ascontiguousarray(codes).view(np.int8).reshape(n, k)
        return BlockQuantWeight("q8", torch.from_numpy(codes), torch.from_numpy(d), None)
    if gguf_type == "Q5_1":  # w = d * q + m, d * q exact: one rounding, q8m's fma
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = _q5_codes(blocks[..., 4:]).reshape(n, k)
        return BlockQuantWeight(
            "q8m", torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)
        )
    if gguf_type == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = blocks[..., 4:]
    else:  # Q4_0: w = d * (code - 8) = d * code + (-8 d), exact in float32
        m = -8.0 * d
        codes = blocks[..., 2:]
    codes = np.ascontiguousarray(codes).reshape(n, k // 2)
    return BlockQuantWeight("q4", torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))


def _q5_codes(packed: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes q in [0, 32) as int8 [..., 32] from a block's 4 + 16 bytes after its
    scales: element j's low four bits are a Q4_0-style nibble, its fifth is bit j of the
    little-endian qh. Q5_0's w = d * (q - 16) is q8's (the product of an fp16 d and a 5-bit
    code is exact), so Q5_0 rides on q8 at one byte a weight; Q5_1 on q8m."""
    qh = packed[..., 0:4].copy().view("<u4")  # [..., 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    qs = packed[..., 4:]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return (low | (high << 4)).astype(np.int8)


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of each super-block from its 12 bytes [..., 12]:
    sub-block j < 4 keeps its scale and min in the low 6 bits of bytes j and j + 4; j >= 4 in the
    nibbles of byte j + 4, with the top 2 bits in the spare high bits of bytes j - 4 and j."""
    lo, hi, mixed = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, mins


def _from_q4_k_or_q5_k(raw: np.ndarray, gguf_type: str, n: int, k: int) -> BlockQuantWeight:
    """Q4_K as q4 planes, Q5_K as q8m, one 32-element sub-block per block.

    gguf computes w = fl(fl(d * sc * q) - dmin * m) with fp16 d, dmin, 6-bit sc, m and 4-bit
    (Q5_K: 5-bit) q, two roundings where q4 and q8m make one (fma). Here they agree: d * sc and
    dmin * m carry at most 11 + 6 significant bits and (d * sc) * q at most 22, all under
    float32's 24, so every product is exact, only the subtraction rounds, and it equals the fma
    fl(d' * q + m') with d' = d * sc and m' = -(dmin * m): the matrix gguf dequantizes, bit for
    bit.
    """
    if k % QK_K:
        raise ValueError(f"K = {k} is not a multiple of the {gguf_type} super-block {QK_K}")
    size = _Q4_K_BYTES if gguf_type == "Q4_K" else _Q5_K_BYTES
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // QK_K, size)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, S, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = _q4_k_scales(blocks[..., 4:16])
    d_sub = (d * sc.astype(np.float32)).reshape(n, k // QBLOCK)
    m_sub = -(dmin * mins.astype(np.float32)).reshape(n, k // QBLOCK)
    # each 32 bytes of codes hold two sub-blocks: the first in the low nibbles, the next in the
    # high ones; Q5_K's 32 bytes of fifth bits hold sub-block i's in bit i of byte t
    qs = blocks[..., -128:].reshape(n, k // QK_K, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    q = (qs & 15).reshape(n, k // QBLOCK, QBLOCK)
    d_sub, m_sub = torch.from_numpy(d_sub), torch.from_numpy(m_sub)
    if gguf_type == "Q5_K":
        qh = (
            blocks[..., 16:48].reshape(n, k // QK_K, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        )
        q = q | ((qh & 1) << 4).reshape(n, k // QBLOCK, QBLOCK)
        return BlockQuantWeight(
            "q8m", torch.from_numpy(q.view(np.int8).reshape(n, k)), d_sub, m_sub
        )
    # q4 wants a block's elements t and t + 16 in the low and high nibble of byte t
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return BlockQuantWeight("q4", torch.from_numpy(codes), d_sub, m_sub)


def _from_q6_k(raw: np.ndarray, n: int, k: int) -> BlockQuantWeight:
    """Q6_K as q8_16: gguf computes w = fl(fl(d * sc) * q) with fp16 d, int8 sc and q in
    [-32, 31]; d * sc carries at most 11 + 8 significant bits, so it is exact and the one
    rounding left is q8's fl(d' * q) with d' = d * sc, a d per 16 codes."""
    if k % QK_K:
        raise ValueError(f"K = {k} is not a multiple of the Q6_K super-block {QK_K}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // QK_K, _Q6_K_BYTES)
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)
    # each half of 128: ql's 64 bytes hold elements 0..63 (low nibbles) and 64..127 (high);
    # qh's 32 bytes hold bits 4..5 of elements 32 s + t in bits 2 s .. 2 s + 1 of byte t
    low = ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    high = qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (low & 15).reshape(n, -1, 2, 4, 32) | ((high & 3) << 4)
    codes = (q.astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    d16 = (d * sc).reshape(n, k // (QBLOCK // 2))
    return BlockQuantWeight("q8_16", torch.from_numpy(codes), torch.from_numpy(d16), None)
