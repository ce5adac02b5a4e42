"""The CPU step's small ops in C (csrc/cpu_ops.c): RMSNorm, RoPE, KV write, paged attention (decode
rows, and extends after a cached prefix) and SiLU-and-multiply. Activations are float32; the KV
cache may be float32, float16 or bfloat16 (rows rounded on store, widened to float32 on read).

Each has the signature of its Triton twin in this package, and the same plain-torch reference
checks it. They exist because at batch 1 a CPU decode step is hundreds of tiny torch ops whose
dispatch costs more than their arithmetic: one C call per op does the same work in one pass.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from prefixrag.kernels._checks import check_gqa, check_kv_cache, check_rank
from prefixrag.kernels.native_build import DEFAULT_FLAGS, load_library

_P, _I, _F, _K = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
_SIGNATURES = {
    "rms_norm": (None, [_P, _P, _P, _F, _P, _P, _I, _I]),
    "rope": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I]),
    "write_kv": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _K, _P, _I, _I, _I]),
    "paged_attention": (
        ctypes.c_int,
        [_P, _I, _P, _P, _K, _I, _P, _I, _I, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _F, _I],
    ),
    "paged_extend_attention": (
        ctypes.c_int,
        [_P, _I, _P, _P, _K, _I, _P, _I, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _F],
    ),
    "silu_mul": (None, [_P, _P, _I, _I]),
    "stream_sum": (ctypes.c_uint64, [_P, _I]),
}


@functools.cache
def build(flags: tuple[str, ...] = DEFAULT_FLAGS) -> ctypes.CDLL:
    """The library, built on first use; raises NativeBuildError without a working C compiler.
    Tests pass other ``flags`` to build the AVX2 and portable paths on an AVX-512 host."""
    # argtypes once, so each call converts plain ints instead of building ctypes objects
    lib = load_library("cpu_ops.c", flags)
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _f32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")


def _rows(name: str, t: torch.Tensor) -> int:
    """The row stride of a [T, ...] tensor whose rows are each contiguous."""
    inner = t[0].is_contiguous() if t.shape[0] else True
    if not inner:
        raise ValueError(f"{name} must be contiguous within each row, got strides {t.stride()}")
    return t.stride(0)


# the KV cache types of csrc/kv_rows.h
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Positions per attention split (csrc/paged_attention.h): a row of more positions is cut into
# splits that threads take separately, then merged in order, so a long context's batch-1
# decode uses every thread. The cut depends on a row's length alone: results are the same
# bits whatever the thread count or batch. 256 keeps a split's partial merge cheap beside its
# positions' reads (a multiple of the kernel's 32-position chunk).
SPLIT_LEN = 256


def kv_kind(cache: torch.Tensor) -> int:
    """The C kernels' code for a KV cache's dtype; ValueError for other dtypes or devices."""
    if cache.dtype not in KV_KINDS or cache.device.type != "cpu":
        raise ValueError(
            f"the KV cache must be a float32, float16 or bfloat16 CPU tensor, got {cache.dtype} "
            f"on {cache.device}"
        )
    return KV_KINDS[cache.dtype]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, s): s = x + residual (or x), out = s * rsqrt(mean(s^2) + eps) * weight.

    x, residual [T, H] float32; weight [H]. Inputs are not modified.
    """
    check_rank("x", x, 2)
    for name, t in (("x", x), ("weight", weight)) + (
        (("residual", residual),) if residual is not None else ()
    ):
        _f32(name, t)
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)} for hidden size {x.shape[1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    out, s = torch.empty_like(x), torch.empty_like(x)
    build().rms_norm(
        x.data_ptr(), residual.data_ptr() if residual is not None else None,
        weight.contiguous().data_ptr(), eps, out.data_ptr(), s.data_ptr(), x.shape[0], x.shape[1],
    )  # fmt: skip
    return out, s


def apply_rope_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hkv, D] in place (they may be column slices of
    one fused qkv matrix); cos_sin_cache [P, D] holds cat(cos, sin) per position."""
    check_rank("q", q, 3)
    check_rank("k", k, 3)
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        _f32(name, t)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not pair up")
    if positions.shape != (num_tokens,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{num_tokens}], got {positions.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [P, {head_dim}], got {tuple(cos_sin_cache.shape)}")
    if num_tokens == 0:
        return
    table = cos_sin_cache.contiguous()
    rc = build().rope(
        q.data_ptr(), _rows("q", q), k.data_ptr(), _rows("k", k),
        positions.contiguous().data_ptr(), table.data_ptr(), table.shape[0],
        num_tokens, num_q_heads, k.shape[1], head_dim,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"positions must lie in [0, {table.shape[0]})")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [T, Hkv, D] (float32) at ``slot_mapping`` [T] (int64) of the paged caches,
    rounded to nearest even when the caches are float16 or bfloat16 (as ``Tensor.to`` does)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        _f32(name, t)
    kind = kv_kind(k_cache)
    if k.shape != v.shape or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache rows")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if k.shape[0] == 0:
        return
    rc = build().write_kv(
        k.data_ptr(), _rows("k", k), v.data_ptr(), _rows("v", v), k_cache.data_ptr(),
        v_cache.data_ptr(), kind, slot_mapping.contiguous().data_ptr(), num_blocks * block_size,
        k.shape[0], num_kv_heads * head_dim,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(
            f"slots must lie in [0, {num_blocks * block_size}) "
            f"(or this build lacks {k_cache.dtype})"
        )


def _check_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tables_of: str,
    index: tuple[tuple[str, torch.Tensor, torch.dtype], ...],
    count: int,
    out: torch.Tensor | None,
) -> tuple[int, int, int, torch.Tensor]:
    """The checks the paged attention calls share: q [T, Hq, D] float32 against the caches,
    int32 block tables [``tables_of``, max_blocks], each ``index`` tensor of its dtype and
    [count], and ``out`` (a new tensor when None). Returns (num_blocks, block_size, the cache's
    kernel kind, out)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_rank("q", q, 3)
    _f32("q", q)
    kind = kv_kind(k_cache)
    check_gqa(q.shape[1], num_kv_heads)
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [{tables_of}, max_blocks]")
    for name, t, dtype in index:
        if t.dtype != dtype or t.shape != (count,):
            raise ValueError(f"{name} must be {dtype} [{count}]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 {tuple(q.shape)}")
    return num_blocks, block_size, kind, out


def paged_attention_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_ids: torch.Tensor,
    row_seqs: torch.Tensor,
    row_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    split_len: int = SPLIT_LEN,
) -> torch.Tensor:
    """Attention for the query rows ``row_ids`` (int64 [R]) of q [T, Hq, D]: row ``row_ids[i]``
    sees the first ``row_lens[i]`` cached positions of sequence ``row_seqs[i]`` (both int32
    [R]), read through its row of ``block_tables`` [S, max_blocks] (int32). Writes those rows of
    ``out`` [T, Hq, D] (a new tensor when None) and returns it; other rows are left as they are.
    The caches may be float32, float16 or bfloat16; the math is float32. Each row's positions
    run in splits of ``split_len`` (a multiple of 32) on separate threads (see SPLIT_LEN).

    Raises ValueError, reading nothing, if a row is out of range, sees no position or more than
    its table holds, or the table names a block the cache does not have.
    """
    if split_len < 32 or split_len % 32:
        raise ValueError(f"split_len must be a positive multiple of 32, got {split_len}")
    num_rows = row_ids.shape[0]
    index = (("row_ids", row_ids, torch.int64), ("row_seqs", row_seqs, torch.int32))
    index += (("row_lens", row_lens, torch.int32),)
    num_blocks, block_size, kind, out = _check_paged(
        q, k_cache, v_cache, block_tables, "num_seqs", index, num_rows, out
    )
    num_q_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_rows == 0:
        return out
    tables = block_tables.contiguous()
    rc = build().paged_attention(
        q.data_ptr(), _rows("q", q), k_cache.data_ptr(), v_cache.data_ptr(), kind, num_blocks,
        tables.data_ptr(), tables.shape[0], tables.shape[1], row_ids.contiguous().data_ptr(),
        row_seqs.contiguous().data_ptr(), row_lens.contiguous().data_ptr(), num_rows, num_q_rows,
        out.data_ptr(), num_q_heads, num_kv_heads, head_dim, block_size, scale, split_len,
    )  # fmt: skip
    if rc == -3:
        raise MemoryError("paged attention could not allocate its split scratch")
    if rc == -2:
        raise ValueError(
            "every row must see >= 1 position that its block table holds, and the table's "
            f"blocks must lie in [0, {num_blocks})"
        )
    if rc != 0:
        raise ValueError(
            f"paged attention supports query groups up to 16, head_dim up to 256 and "
            f"kv_heads * head_dim up to 8192, got {num_q_heads // num_kv_heads}, {head_dim} and "
            f"{num_kv_heads * head_dim} "
            f"(or this build lacks {k_cache.dtype})"
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    split_len: int = SPLIT_LEN,
) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], against its first ``seq_lens[b]`` (int32)
    cached positions, read through ``block_tables`` [B, max_blocks] (int32) -> [B, Hq, D]."""
    batch = q.shape[0]
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be int32 [{batch}]")
    rows = torch.arange(batch)
    return paged_attention_rows(
        q, k_cache, v_cache, block_tables, rows, rows.int(), seq_lens, scale, split_len=split_len
    )


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of extends over their cached prefix and themselves, read in place.

    Extend ``e`` owns the ``extend_lens[e]`` rows of q [T, Hq, D] from ``q_starts[e]`` (int64
    [E]); its row r sits at position ``prefix_lens[e] + r`` (int32 [E], as ``extend_lens``) and
    sees positions 0 .. ``prefix_lens[e] + r`` of the sequence whose block table is row e of
    ``block_tables`` [E, max_blocks] (int32), its own new K/V already written there. Writes
    those rows of ``out`` [T, Hq, D] (a new tensor when None) and returns it.

    The attention of :func:`paged_attention_rows` per row, to float32 accuracy, but rows share
    the reads: a tile of up to 32 rows widens each chunk of 32 cached positions once and scores
    it as a small matrix product (csrc/extend_tiles.h), where the per-row kernel rereads the
    whole prefix for every row. On hosts with AMX (:func:`extend_amx_ready`), a float16 or
    bfloat16 cache takes its bfloat16 tile products instead (csrc/extend_amx.h), still to
    float32 accuracy. A row's result depends on that row alone. Raises ValueError, reading
    nothing, for rows outside q, an empty extend or a table that is too short or names a block
    the cache does not have.
    """
    num_ext = block_tables.shape[0] if block_tables.dim() == 2 else 0
    index = (("q_starts", q_starts, torch.int64), ("prefix_lens", prefix_lens, torch.int32))
    index += (("extend_lens", extend_lens, torch.int32),)
    num_blocks, block_size, kind, out = _check_paged(
        q, k_cache, v_cache, block_tables, "num_extends", index, num_ext, out
    )
    num_q_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_ext == 0 or num_q_rows == 0:
        return out
    tables = block_tables.contiguous()
    rc = build().paged_extend_attention(
        q.data_ptr(), _rows("q", q), k_cache.data_ptr(), v_cache.data_ptr(), kind, num_blocks,
        tables.data_ptr(), tables.shape[1], q_starts.contiguous().data_ptr(),
        prefix_lens.contiguous().data_ptr(), extend_lens.contiguous().data_ptr(), num_ext,
        num_q_rows, out.data_ptr(), num_q_heads, num_kv_heads, head_dim, block_size, scale,
    )  # fmt: skip
    if rc == -3:
        raise MemoryError("extend attention could not allocate its scratch")
    if rc == -2:
        raise ValueError(
            "every extend needs >= 1 row inside q and a block table that holds its positions, "
            f"with blocks in [0, {num_blocks})"
        )
    if rc != 0:
        raise ValueError(
            f"extend attention supports query groups up to 16 and head_dim up to 256, got "
            f"{num_q_heads // num_kv_heads} and {head_dim} (or this build lacks {k_cache.dtype})"
        )
    return out


def extend_amx_ready(head_dim: int) -> bool:
    """True when :func:`paged_extend_attention` takes AMX for a 16-bit cache of ``head_dim``:
    the build has it (an AMX-BF16 host), Linux lets the process use it, and ``head_dim`` is a
    multiple of 32."""
    return bool(build().extend_amx_ready(head_dim))  # an int: ctypes' default argument type


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I] (gate columns first) -> [T, I], in the C loop at
    every T: its vector exponential (csrc/fast_exp.h) took 24 us at 32 rows of SmolLM2's 1,536
    columns and 1.2 ms at 2,080, where ``F.silu(gate) * up`` took 40 us and 2.2 ms (2 threads,
    2-core Xeon)."""
    check_rank("gate_up", gate_up, 2)
    _f32("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up needs an even width, got {gate_up.shape[1]}")
    inter = gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], inter, dtype=torch.float32)
    if gate_up.shape[0]:
        build().silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter)
    return out


def stream_sum(data: torch.Tensor) -> int:
    """The sum of a contiguous CPU tensor's bytes read as 64-bit words, every thread
    streaming its share once: the bench's measure of a read at memory speed (what a decode
    step's weight reads are set against). Bytes past the last whole word are left out."""
    if data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError("stream_sum reads a contiguous CPU tensor")
    num_words = data.numel() * data.element_size() // 8
    return int(build().stream_sum(data.data_ptr(), num_words)) if num_words else 0
