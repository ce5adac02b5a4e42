"""One decode step of a whole Llama-family decoder stack in one C call (csrc/decode_step.c).

For CPU decode with GGUF block weights (:class:`BlockQuantWeight`): a batch-1 step is ~30 layers
of a dozen small ops, and through torch each op pays a few microseconds of dispatch; this runs
the norms, block matmuls, RoPE, KV-cache write, paged attention and SwiGLU of every layer in one
OpenMP region. :class:`DecodeStack` holds the per-layer pointers once; :meth:`DecodeStack.run`
takes the step's embeddings and index tensors.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from prefixrag.kernels.block_quant_matmul import _KIND, MAX_K, QBLOCK, BlockQuantWeight
from prefixrag.kernels.block_stack import BlockStack
from prefixrag.kernels.cpu_ops import KV_KINDS, SPLIT_LEN
from prefixrag.kernels.native_build import DEFAULT_FLAGS, load_library

# csrc/block_quant.h's kind for plain float32 rows (a float32 model's weights)
KIND_F32 = 32

# Decode batches past this many rows are better served by the GEMM path (csrc/decode_step.c
# has the same bound).
MAX_ROWS = 16
_MAX_GROUP, _MAX_HEAD_DIM = 16, 256
# parts a stacked weight may have (q, k, v), csrc/decode_step.c's MAX_PARTS
MAX_PARTS = 3


class _Part(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("codes", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
    ]


class _Weight(ctypes.Structure):
    _fields_ = [
        ("num_parts", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("parts", _Part * MAX_PARTS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("o_bias", ctypes.c_void_p),
        ("qkv", _Weight),
        ("o", _Weight),
        ("gate_up", _Weight),
        ("down", _Weight),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "hidden", "heads", "kv_heads", "head_dim", "inter", "bs", "num_blocks", "max_blocks"
        )
    ] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("kv_kind", ctypes.c_int32), ("split_len", ctypes.c_int32),
        ("act_q8", ctypes.c_int32), ("pad", ctypes.c_int32),
    ]  # fmt: skip


class _Scratch(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p) for name in ("residual", "h", "qkv", "attn", "gate_up", "act")
    ]


@functools.cache
def build(flags: tuple[str, ...] = DEFAULT_FLAGS) -> ctypes.CDLL:
    """The library, built on first use; raises NativeBuildError without a working C compiler.
    ``flags``: the compiler's (bench/kernel_flags_ab.py compares builds)."""
    lib = load_library("decode_step.c", flags)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.decode_step.restype = ctypes.c_int
    lib.decode_step.argtypes = [
        ctypes.POINTER(_Shape), ctypes.POINTER(_Layer), i64, p, i64, p, p, p, p, p, i64,
        ctypes.POINTER(_Scratch),
    ]  # fmt: skip
    return lib


@dataclass(slots=True)
class DecodeLayer:
    """One layer's weights and KV cache as the C step reads them (on CPU; float32, but for the
    KV cache, which may be float16 or bfloat16 too). A weight is GGUF blocks or a plain float32
    matrix (a float32 model; not with int8 activations)."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv: BlockQuantWeight | BlockStack | torch.Tensor  # [(Hq + 2 Hkv) D, H]
    o: BlockQuantWeight | BlockStack | torch.Tensor  # [H, Hq D]
    gate_up: BlockQuantWeight | BlockStack | torch.Tensor  # [2 I, H]
    down: BlockQuantWeight | BlockStack | torch.Tensor  # [H, I]
    k_cache: torch.Tensor  # [num_blocks, bs, Hkv, D]
    v_cache: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


def _weight(w: BlockQuantWeight | BlockStack | torch.Tensor, n: int, k: int, name: str) -> _Weight:
    if tuple(w.shape) != (n, k):
        raise ValueError(f"{name} is {tuple(w.shape)}, the stack needs ({n}, {k})")
    if k % QBLOCK or k > MAX_K:
        raise ValueError(f"{name}: K = {k} must be a multiple of {QBLOCK} up to {MAX_K}")
    if isinstance(w, torch.Tensor):
        if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 CPU matrix, got {w.dtype}")
        parts = [_Part(KIND_F32, 0, w.data_ptr(), None, None, n)]
    else:
        blocks = w.parts if isinstance(w, BlockStack) else (w,)
        if len(blocks) > MAX_PARTS:
            raise ValueError(f"{name} has {len(blocks)} parts, the C step takes {MAX_PARTS}")
        parts = [_part(p, name) for p in blocks]
    weight = _Weight(len(parts), 0)
    for i, part in enumerate(parts):
        weight.parts[i] = part
    return weight


def _part(w: BlockQuantWeight, name: str) -> _Part:
    if w.is_kquant and w.codes.stride(0) != w.codes.shape[1]:
        raise ValueError(f"{name}: {w.kind} rows must lie back to back")
    d = 0 if w.d is None else w.d.data_ptr()
    m = 0 if w.m is None else w.m.data_ptr()
    return _Part(_KIND[w.kind], 0, w.codes.data_ptr(), d, m, w.shape[0])


def _f32_vector(t: torch.Tensor | None, size: int, name: str) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or t.shape != (size,) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 [{size}], got {t.dtype} {t.shape}")
    return t.data_ptr()


class DecodeStack:
    """A decoder stack wired for :func:`decode_step`; it keeps every tensor it points at alive.

    ``cos_sin_cache`` [P, D] holds cat(cos, sin) per position (the model's RoPE table).
    Raises ValueError for shapes the C step does not take. Attention runs each row's positions
    in splits of ``split_len`` (cpu_ops.SPLIT_LEN: the same cut as the per-op C attention, so
    both give a sequence the same bits).
    """

    def __init__(
        self,
        layers: list[DecodeLayer],
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        cos_sin_cache: torch.Tensor,
        split_len: int = SPLIT_LEN,
        int8_activations: bool = False,
    ) -> None:
        if not layers:
            raise ValueError("a decode stack needs at least one layer")
        if heads % kv_heads or heads // kv_heads > _MAX_GROUP or head_dim > _MAX_HEAD_DIM:
            raise ValueError(f"unsupported heads {heads}/{kv_heads} of dim {head_dim}")
        hidden, inter = layers[0].qkv.shape[1], layers[0].down.shape[1]
        num_blocks, bs = layers[0].k_cache.shape[:2]
        self._keep = (layers, cos_sin_cache)
        self._cos_sin = cos_sin_cache
        if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[1:] != (head_dim,):
            raise ValueError(f"cos_sin_cache must be float32 [P, {head_dim}]")
        if split_len < 32 or split_len % 32:
            raise ValueError(f"split_len must be a positive multiple of 32, got {split_len}")
        kv_dtype = layers[0].k_cache.dtype
        if kv_dtype not in KV_KINDS:
            raise ValueError(f"the KV cache must be float32, float16 or bfloat16, not {kv_dtype}")
        qkv_width = (heads + 2 * kv_heads) * head_dim
        weights = (w for ly in layers for w in (ly.qkv, ly.o, ly.gate_up, ly.down))
        if int8_activations and any(isinstance(w, torch.Tensor) for w in weights):
            raise ValueError("int8 activations need GGUF block weights, not float32 matrices")
        self._layers = (_Layer * len(layers))()
        for i, ly in enumerate(layers):
            for cache in (ly.k_cache, ly.v_cache):
                want = (num_blocks, bs, kv_heads, head_dim)
                if cache.dtype != kv_dtype or tuple(cache.shape) != want:
                    raise ValueError(f"layer {i}: KV cache must be {kv_dtype} {want}")
                if not cache.is_contiguous():
                    raise ValueError(f"layer {i}: KV cache must be contiguous")
            self._layers[i] = _Layer(
                _f32_vector(ly.input_norm, hidden, "input_norm"),
                _f32_vector(ly.post_norm, hidden, "post_norm"),
                _f32_vector(ly.qkv_bias, qkv_width, "qkv_bias"),
                _f32_vector(ly.o_bias, hidden, "o_bias"),
                _weight(ly.qkv, qkv_width, hidden, f"layer {i} qkv"),
                _weight(ly.o, hidden, heads * head_dim, f"layer {i} o"),
                _weight(ly.gate_up, 2 * inter, hidden, f"layer {i} gate_up"),
                _weight(ly.down, hidden, inter, f"layer {i} down"),
                ly.k_cache.data_ptr(),
                ly.v_cache.data_ptr(),
            )
        self.hidden, self.inter, self.qkv_width = hidden, inter, qkv_width
        self.heads, self.head_dim = heads, head_dim
        self._dims = (hidden, heads, kv_heads, head_dim, inter, bs, num_blocks)
        self._eps, self._scale = eps, scale
        self._kv_kind, self._split_len = KV_KINDS[kv_dtype], split_len
        self.int8_activations = int8_activations
        self._scratch: dict[int, tuple[_Scratch, tuple[torch.Tensor, ...]]] = {}

    def _scratch_for(self, rows: int) -> _Scratch:
        if rows not in self._scratch:
            widths = (self.hidden, self.hidden, self.qkv_width, self.heads * self.head_dim)
            bufs = tuple(torch.empty(rows, w) for w in (*widths, 2 * self.inter, self.inter))
            self._scratch[rows] = (_Scratch(*(b.data_ptr() for b in bufs)), bufs)
        return self._scratch[rows][0]

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One step for B sequences: x [B, H] float32 token embeddings, overwritten with (and
        returned as) the hidden states before the final norm; positions and KV ``slots`` int64
        [B]; ``block_tables`` int32 [B, max_blocks]; ``seq_lens`` int32 [B], new token included.

        Raises ValueError, touching no cache, for an index out of range.
        """
        rows = x.shape[0]
        if x.dtype != torch.float32 or x.shape != (rows, self.hidden) or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous float32 [B, {self.hidden}]")
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"a decode stack step takes 1 to {MAX_ROWS} rows, got {rows}")
        for name, t, dtype in (
            ("positions", positions, torch.int64),
            ("slots", slots, torch.int64),
            ("seq_lens", seq_lens, torch.int32),
        ):
            if t.dtype != dtype or t.shape != (rows,) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dtype} [{rows}]")
        if (
            block_tables.dtype != torch.int32
            or block_tables.dim() != 2
            or len(block_tables) != rows
        ):
            raise ValueError(f"block_tables must be int32 [{rows}, max_blocks]")
        tables = block_tables.contiguous()
        shape = _Shape(
            *self._dims, tables.shape[1], self._eps, self._scale, self._kv_kind, self._split_len,
            int(self.int8_activations), 0,
        )  # fmt: skip
        rc = build().decode_step(
            ctypes.byref(shape), self._layers, len(self._layers), x.data_ptr(), rows,
            positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(),
            self._cos_sin.data_ptr(), self._cos_sin.shape[0], ctypes.byref(self._scratch_for(rows)),
        )  # fmt: skip
        if rc == -2:
            raise ValueError("a position, KV slot, sequence length or block id is out of range")
        if rc == -3:
            raise MemoryError("decode_step could not allocate its attention scratch")
        if rc != 0:
            raise ValueError("decode_step rejected the stack's shapes (or its KV cache dtype)")
        return x
