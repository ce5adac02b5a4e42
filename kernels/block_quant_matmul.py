"""Matmul with GGUF block-quantized weights on CPU.

A :class:`BlockQuantWeight` keeps a weight matrix [N, K] in the checkpoint's own 32-element
blocks, split into planes the kernel reads directly: 4-bit codes and per-block float32 scale ``d``
and offset ``m`` (w = d * code + m), or int8 codes and ``d`` (w = d * code, d per 16 or 32
codes) and optionally ``m``; kernels/gguf_planes.py turns GGUF tensors into them. For
SmolLM2's Q4_1 layers that is 0.75 bytes a weight instead of float32's 4, and decode, which must
read every weight once per step, is bandwidth-bound. The float32 matrix it stands for is exactly
gguf's dequantization, so logits stay those of the dequantized model up to summation order.

Two kinds are no planes at all: ``q4_k`` and ``q6_k`` keep a GGUF file's own Q4_K and Q6_K
rows (uint8 [N, K/256 * 144] and [N, K/256 * 210]), usually a view into the mapped file, and the
kernels widen each row's scales as they reach it (csrc/kquant_rows.h): the same bits as the
planes they would convert to, at the file's 4.5 and 6.56 bits a weight.

``block_quant_matmul`` is the C kernel (csrc/block_quant_matmul.c); its torch references are in
kernels/block_quant_reference.py.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from prefixrag.kernels.native_build import DEFAULT_FLAGS, load_library

QBLOCK = 32
MAX_K = 16384
QK_K = 256
_KIND = {"q4": 4, "q8": 8, "q8_16": 16, "q8m": 9, "q4_k": 44, "q6_k": 66}
# elements per scale: q8_16 is q8 with a d per 16 codes (Q6_K's sub-blocks)
SCALE_BLOCK = {"q4": QBLOCK, "q8": QBLOCK, "q8_16": QBLOCK // 2, "q8m": QBLOCK}
_WITH_M = ("q4", "q8m")
# the file's own rows: bytes per super-block of 256 weights, and the GGUF type they come from
KQUANT_BYTES = {"q4_k": 144, "q6_k": 210}
KQUANT_GGUF_TYPES = {"q4_k": "Q4_K", "q6_k": "Q6_K"}


@dataclass(slots=True)
class BlockQuantWeight:
    """A [N, K] matrix as block planes: ``kind`` ``q4`` (codes uint8 [N, K/2], d and m float32
    [N, K/32]), ``q8`` (codes int8 [N, K], d float32 [N, K/32], m None), ``q8_16`` (as q8 with
    d [N, K/16]) or ``q8m`` (as q8 with m, w = d * code + m as q4); or a GGUF file's own rows,
    ``q4_k`` or ``q6_k`` (codes uint8 [N, K/256 * bytes per super-block], d and m None)."""

    kind: str
    codes: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None
    # the float32 matrix, kept by the engine for prefill-sized matmuls when memory allows (in
    # the engine's packed GEMM layout where it can: engine/packed_gemm.py)
    dense: object | None = field(default=None, repr=False, compare=False)
    # decode-sized matmuls quantize x to int8 first (engine option int8_activations)
    int8_activations: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KIND:
            raise ValueError(f"kind must be one of {', '.join(_KIND)}, got {self.kind!r}")
        if self.kind in KQUANT_BYTES:
            self._check_kquant()
            return
        if self.d is None or self.d.dtype != torch.float32 or self.d.dim() != 2:
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

    def _check_kquant(self) -> None:
        size = KQUANT_BYTES[self.kind]
        c = self.codes
        if c.dtype != torch.uint8 or c.dim() != 2 or c.shape[1] % size or c.stride(1) != 1:
            raise ValueError(
                f"{self.kind} codes must be uint8 [N, K/256 * {size}] with contiguous rows, "
                f"got {c.dtype} {tuple(c.shape)}"
            )
        if self.d is not None or self.m is not None:
            raise ValueError(f"{self.kind} weights carry their scales in their rows: no d or m")

    @property
    def is_kquant(self) -> bool:
        """A GGUF file's own K-quant rows (no planes)."""
        return self.kind in KQUANT_BYTES

    @property
    def shape(self) -> torch.Size:
        if self.kind in KQUANT_BYTES:
            rows, row_bytes = self.codes.shape
            return torch.Size((rows, row_bytes // KQUANT_BYTES[self.kind] * QK_K))
        assert self.d is not None
        return torch.Size((self.d.shape[0], self.d.shape[1] * SCALE_BLOCK[self.kind]))

    @property
    def nbytes(self) -> int:
        """The bytes a full read of the weight touches (codes and planes)."""
        planes = (self.codes, self.d, self.m)
        return sum(t.numel() * t.element_size() for t in planes if t is not None)

    def select_rows(self, index: torch.Tensor) -> BlockQuantWeight:
        """The rows ``index`` (a row permutation or a subset), as a new weight."""
        if self.kind in KQUANT_BYTES:
            return BlockQuantWeight(self.kind, self.codes[index].contiguous(), None, None)
        assert self.d is not None
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
        if kinds & set(KQUANT_BYTES):
            return False  # a file's rows are views: stack them (kernels/block_stack.py) instead
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


def _check(x: torch.Tensor, w: BlockQuantWeight) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    k = w.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    if k > MAX_K:
        raise ValueError(f"K = {k} is over the kernel's limit of {MAX_K}")
    if w.is_kquant and w.codes.stride(0) != w.codes.shape[1]:
        raise ValueError(f"{w.kind} rows must lie back to back")


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def block_quant_matmul(
    x: torch.Tensor,
    w: BlockQuantWeight,
    flags: tuple[str, ...] = DEFAULT_FLAGS,
    *,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``x @ W.T`` for float32 x [..., K] -> [..., N], the weight expanded row by row in cache.

    A row's result does not depend on how many rows share the call, nor on the SIMD path the
    build took. ``flags`` picks the build (tests build the AVX2 path with ``-mno-avx512f`` and
    the portable one with ``-mno-avx512f -mno-avx2``). ``int8_activations`` quantizes x's rows
    to int8 per block of 32 first, as llama.cpp's decode does (csrc/q8_act.h; see
    :func:`q8_activations_fast` and block_quant_reference.block_quant_matmul_q8a_torch).
    """
    entry = "block_quant_matmul_q8a" if int8_activations else "block_quant_matmul"
    return _run_matmul(entry, x, w, flags, f"block_quant_matmul rejected K = {w.shape[1]}")


def _run_matmul(
    entry: str, x: torch.Tensor, w: BlockQuantWeight, flags: tuple[str, ...], rejected: str
) -> torch.Tensor:
    """x @ W.T through the C entry point ``entry`` of the build with ``flags`` (they share one
    signature); ``rejected`` is the ValueError's message when the kernel refuses."""
    _check(x, w)
    n, k = w.shape
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    if x2.shape[0]:
        rc = getattr(load_library("block_quant_matmul.c", flags), entry)(
            ctypes.c_int(_KIND[w.kind]), _ptr(x2), _ptr(w.codes), _ptr(w.d), _ptr(w.m),
            _ptr(out), ctypes.c_int64(x2.shape[0]), ctypes.c_int64(n), ctypes.c_int64(k),
        )  # fmt: skip
        if rc == -3:
            raise MemoryError(f"{entry} could not allocate its scratch memory")
        if rc != 0:
            raise ValueError(rejected)
    return out.reshape(*x.shape[:-1], n)


def amx_ready(flags: tuple[str, ...] = DEFAULT_FLAGS) -> bool:
    """True when the build with ``flags`` has the AMX path (csrc/amx_matmul.h: an AMX-BF16
    host) and Linux lets this process use the tile registers."""
    return bool(load_library("block_quant_matmul.c", flags).block_quant_amx_ready())


def block_quant_matmul_amx(
    x: torch.Tensor, w: BlockQuantWeight, flags: tuple[str, ...] = DEFAULT_FLAGS
) -> torch.Tensor:
    """``x @ W.T`` as :func:`block_quant_matmul`, on AMX's bfloat16 tile products, the
    dequantized weights and x each split into three parts that add up to them exactly
    (csrc/amx_matmul.h): float32 accuracy in another summation order, so not the block kernel's
    bits. Raises ValueError where :func:`amx_ready` is False."""
    rejected = "no AMX here (see amx_ready), or K is not a multiple of 32"
    if w.is_kquant:
        raise ValueError(f"the AMX path reads plane kinds only, not {w.kind}")
    return _run_matmul("block_quant_matmul_amx", x, w, flags, rejected)


def q8_activations_fast(flags: tuple[str, ...] = DEFAULT_FLAGS) -> bool:
    """True when the build with ``flags`` runs int8 activations on AVX-512 VNNI or AVX2.
    Elsewhere they take portable C loops, slower than the float32 path, kept as the vector
    paths' yardstick."""
    return bool(load_library("block_quant_matmul.c", flags).block_quant_q8a_fast())


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


def tile_min_rows(flags: tuple[str, ...] = DEFAULT_FLAGS) -> int:
    """The fewest rows of x that take the block kernel's tiles (csrc/block_tiles.h) in the build
    with ``flags``, 0 where it has none (it needs AVX-512): the same bits, sooner, at tens of
    rows."""
    return int(load_library("block_quant_matmul.c", flags).block_quant_tile_min_rows())


def simd_lanes(flags: tuple[str, ...] = DEFAULT_FLAGS) -> int:
    """The vector width the build with ``flags`` took: 16 (AVX-512), 8 (AVX2+FMA), 1 (portable)."""
    return int(load_library("block_quant_matmul.c", flags).block_quant_lanes())


def block_quant_dequantize(
    w: BlockQuantWeight, flags: tuple[str, ...] = DEFAULT_FLAGS
) -> torch.Tensor:
    """The float32 matrix [N, K] through the C kernel (bit-identical to gguf's dequantizer)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32)
    block_quant_dequantize_into(w, out, flags)
    return out


def block_quant_dequantize_into(
    w: BlockQuantWeight, out: torch.Tensor, flags: tuple[str, ...] = DEFAULT_FLAGS
) -> None:
    """:func:`block_quant_dequantize` written into ``out``: contiguous [N, K] (rows of a larger
    matrix, say), float32, or bfloat16 for the float32 matrix rounded (its
    ``.to(torch.bfloat16)``, bit for bit, at half the bytes written)."""
    n, k = w.shape
    entries = {
        torch.float32: "block_quant_dequantize",
        torch.bfloat16: "block_quant_dequantize_bf16",
    }
    if out.dtype not in entries or tuple(out.shape) != (n, k) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 or bfloat16 [{n}, {k}]")
    entry = entries[out.dtype]
    rc = getattr(load_library("block_quant_matmul.c", flags), entry)(
        ctypes.c_int(_KIND[w.kind]), _ptr(w.codes), _ptr(w.d), _ptr(w.m), _ptr(out),
        ctypes.c_int64(n), ctypes.c_int64(k),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"{entry} rejected K = {k}")


def block_quant_rows(
    w: BlockQuantWeight, ids: torch.Tensor, flags: tuple[str, ...] = DEFAULT_FLAGS
) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of the float32 matrix, [*ids.shape, K]: an embedding
    lookup that widens only the rows a step reads. Raises IndexError for an id out of range."""
    n, k = w.shape
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    lib = load_library("block_quant_matmul.c", flags)
    rc = lib.block_quant_dequantize_rows(
        ctypes.c_int(_KIND[w.kind]), _ptr(w.codes), _ptr(w.d), _ptr(w.m), _ptr(flat),
        ctypes.c_int64(flat.numel()), _ptr(out), ctypes.c_int64(n), ctypes.c_int64(k),
    )  # fmt: skip
    if rc == -2:
        raise IndexError(f"a token id is outside the embedding's {n} rows")
    if rc != 0:
        raise ValueError(f"block_quant_dequantize_rows rejected K = {k}")
    return out.reshape(*ids.shape, k)
