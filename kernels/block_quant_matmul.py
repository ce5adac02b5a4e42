"""Matmul with GGUF block-quantized weights on CPU (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K), beside its torch reference.

A :class:`BlockQuantWeight` keeps a weight matrix [N, K] in the checkpoint's own 32-element
blocks, split into planes the kernel reads directly: 4-bit codes and per-block float32 scale ``d``
and offset ``m`` (w = d * code + m), or int8 codes and ``d`` (w = d * code). For
SmolLM2's Q4_1 layers that is 0.75 bytes a weight instead of float32's 4, and decode, which must
read every weight once per step, is bandwidth-bound. The float32 matrix it stands for is exactly
gguf's dequantization, so logits stay those of the dequantized model up to summation order.

``block_quant_matmul`` is the C kernel (csrc/block_quant_matmul.c); ``block_quant_matmul_torch``
is the reference.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch

from prefixrag.kernels.native_build import DEFAULT_FLAGS, load_library

QBLOCK = 32
MAX_K = 16384
_KIND = {"q4": 4, "q8": 8, "q8_16": 16, "q8m": 9}
# elements per scale: q8_16 is q8 with a d per 16 codes (Q6_K's sub-blocks)
_SCALE_BLOCK = {"q4": QBLOCK, "q8": QBLOCK, "q8_16": QBLOCK // 2, "q8m": QBLOCK}
_WITH_M = ("q4", "q8m")
# GGUF block sizes in bytes: fp16 d [, fp16 m], codes (Q5_0 and Q5_1: 32 high bits, then low
# nibbles)
_Q4_0_BYTES, _Q4_1_BYTES, _Q8_0_BYTES, _Q5_0_BYTES, _Q5_1_BYTES = 18, 20, 34, 22, 24
# Q4_K: super-blocks of 256, fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of codes;
# Q5_K: Q4_K's fields and 32 bytes of fifth bits before the codes;
# Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d
QK_K, _Q4_K_BYTES, _Q5_K_BYTES, _Q6_K_BYTES = 256, 144, 176, 210
SUPPORTED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass(slots=True)
class BlockQuantWeight:
    """A [N, K] matrix as block planes: ``kind`` ``q4`` (codes uint8 [N, K/2], d and m float32
    [N, K/32]), ``q8`` (codes int8 [N, K], d float32 [N, K/32], m None), ``q8_16`` (as q8 with
    d [N, K/16]) or ``q8m`` (as q8 with m, w = d * code + m as q4)."""

    kind: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    # the float32 matrix, kept by the engine for prefill-sized matmuls when memory allows
    dense: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KIND:
            raise ValueError(f"kind must be one of {', '.join(_KIND)}, got {self.kind!r}")
        if self.d.dtype != torch.float32 or self.d.dim() != 2:
            raise ValueError("d must be a 2-D float32 tensor [N, K/32] (q8_16: [N, K/16])")
        n, k = self.shape
        if k % QBLOCK:
            raise ValueError(f"K = {k} is not a multiple of the block size {QBLOCK}")
        want = (torch.uint8, (n, k // 2)) if self.kind == "q4" else (torch.int8, (n, k))
        if self.codes.dtype != want[0] or tuple(self.codes.shape) != want[1]:
            raise ValueError(
                f"{self.kind} codes must be {want[0]} {want[1]}, "
                f"got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        if (self.kind in _WITH_M) != (self.m is not None):
            raise ValueError("q4 and q8m weights need m; q8 and q8_16 weights take none")
        if self.m is not None and self.m.shape != self.d.shape:
            raise ValueError(f"m {tuple(self.m.shape)} must match d {tuple(self.d.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.d.shape[0], self.d.shape[1] * _SCALE_BLOCK[self.kind]))

    def select_rows(self, index: torch.Tensor) -> BlockQuantWeight:
        """The rows ``index`` (a row permutation or a subset), as a new weight."""
        m = None if self.m is None else self.m[index].contiguous()
        return BlockQuantWeight(
            self.kind, self.codes[index].contiguous(), self.d[index].contiguous(), m
        )

    def as_q8m(self) -> BlockQuantWeight:
        """A q8 weight as q8m with m = -0.0: fma(d, c, -0.0) is d * c exactly, zero signs too."""
        if self.kind != "q8":
            raise ValueError(f"only q8 converts to q8m, not {self.kind}")
        return BlockQuantWeight("q8m", self.codes, self.d, torch.full_like(self.d, -0.0))

    @staticmethod
    def can_fuse(parts: list[BlockQuantWeight]) -> bool:
        """True when :meth:`cat` takes these: one kind, or q8 beside q8m (a Q5_1 q beside a
        Q8_0 v, say), and one K."""
        kinds = {p.kind for p in parts}
        return (len(kinds) == 1 or kinds == {"q8", "q8m"}) and len({p.shape[1] for p in parts}) == 1

    @staticmethod
    def cat(parts: list[BlockQuantWeight]) -> BlockQuantWeight:
        """Stack weights of one K along N (fused q/k/v, gate/up); see :meth:`can_fuse`."""
        if not BlockQuantWeight.can_fuse(parts):
            kinds = sorted({p.kind for p in parts})
            raise ValueError(f"cannot fuse weights of kinds {kinds} or of different K")
        if len({p.kind for p in parts}) > 1:
            parts = [p.as_q8m() if p.kind == "q8" else p for p in parts]
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])  # type: ignore[misc]
        return BlockQuantWeight(
            parts[0].kind,
            torch.cat([p.codes for p in parts]),
            torch.cat([p.d for p in parts]),
            m,
        )


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


def dequantize_torch(w: BlockQuantWeight) -> torch.Tensor:
    """The float32 matrix [N, K] in torch (the reference)."""
    n, k = w.shape
    d = w.d.repeat_interleave(_SCALE_BLOCK[w.kind], dim=1)
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


def _check(x: torch.Tensor, w: BlockQuantWeight) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    k = w.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    if k > MAX_K:
        raise ValueError(f"K = {k} is over the kernel's limit of {MAX_K}")


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def block_quant_matmul(
    x: torch.Tensor, w: BlockQuantWeight, flags: tuple[str, ...] = DEFAULT_FLAGS
) -> torch.Tensor:
    """``x @ W.T`` for float32 x [..., K] -> [..., N], the weight expanded row by row in cache.

    A row's result does not depend on how many rows share the call, nor on the SIMD path the
    build took. ``flags`` picks the build (tests build the AVX2 path with ``-mno-avx512f`` and
    the portable one with ``-mno-avx512f -mno-avx2``).
    """
    _check(x, w)
    n, k = w.shape
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if x2.shape[0]:
        lib = load_library("block_quant_matmul.c", flags)
        rc = lib.block_quant_matmul(
            ctypes.c_int(_KIND[w.kind]), _ptr(x2), _ptr(w.codes), _ptr(w.d), _ptr(w.m),
            _ptr(out), ctypes.c_int64(x2.shape[0]), ctypes.c_int64(n), ctypes.c_int64(k),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"block_quant_matmul rejected K = {k}")
    return out.reshape(*x.shape[:-1], n)


def fixed_order_matmul(
    x: torch.Tensor, w: torch.Tensor, flags: tuple[str, ...] = DEFAULT_FLAGS
) -> torch.Tensor:
    """``x @ w.T`` for float32 x [M, K] and w [N, K], each dot product summed in the block
    kernel's fixed order: ``block_quant_matmul(x, bw)`` equals it over ``bw``'s dequantized
    matrix, bit for bit, with the same ``flags``."""
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        raise ValueError(f"x and w must be float32, got {x.dtype} and {w.dtype}")
    (m, k), n = x.shape, w.shape[0]
    if w.shape[1] != k or k % QBLOCK:
        raise ValueError(f"K must match and be a multiple of {QBLOCK}: {k}, {w.shape[1]}")
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    lib = load_library("block_quant_matmul.c", flags)
    rc = lib.fixed_order_matmul(
        _ptr(x), _ptr(w), _ptr(out),
        ctypes.c_int64(m), ctypes.c_int64(n), ctypes.c_int64(k),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"fixed_order_matmul rejected K = {k}")
    return out


def simd_lanes(flags: tuple[str, ...] = DEFAULT_FLAGS) -> int:
    """The vector width the build with ``flags`` took: 16 (AVX-512), 8 (AVX2+FMA), 1 (portable)."""
    return int(load_library("block_quant_matmul.c", flags).block_quant_lanes())


def block_quant_dequantize(
    w: BlockQuantWeight, flags: tuple[str, ...] = DEFAULT_FLAGS
) -> torch.Tensor:
    """The float32 matrix [N, K] through the C kernel (bit-identical to gguf's dequantizer)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32)
    lib = load_library("block_quant_matmul.c", flags)
    rc = lib.block_quant_dequantize(
        ctypes.c_int(_KIND[w.kind]), _ptr(w.codes), _ptr(w.d), _ptr(w.m), _ptr(out),
        ctypes.c_int64(n), ctypes.c_int64(k),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"block_quant_dequantize rejected K = {k}")
    return out
