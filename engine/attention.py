"""Per-step attention metadata and the attention backends that read/write the paged KV cache.

KV layout (shared with kernels/): per layer ``k_cache``/``v_cache`` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; position p of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

A step packs decode tokens first (one new token per sequence), then extend tokens (prefill chunks,
possibly after a cached prefix). Metadata is built once per step and shared by every layer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "torch", "native", "triton", "reference")
log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqSpan:
    """One sequence in a step: ``num_new`` tokens starting at position ``start_pos``."""

    start_pos: int
    num_new: int
    block_ids: Sequence[int]


@dataclass(slots=True)
class AttentionMetadata:
    """Index tensors for one step; decode sequences come first, then extend sequences."""

    slot_mapping: torch.Tensor  # int64 [T]
    scale: float
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # int32 [Bd, max_blocks], -1 padded
    decode_seq_lens: torch.Tensor  # int32 [Bd], includes the new token
    extend_block_tables: torch.Tensor  # int32 [Be, max_blocks], -1 padded
    extend_prefix_lens: torch.Tensor  # int32 [Be]
    extend_lens: torch.Tensor  # int32 [Be]
    cu_extend: torch.Tensor  # int32 [Be + 1], offsets into the extend part of q
    decode_seq_lens_host: list[int]
    extend_prefix_lens_host: list[int]
    extend_lens_host: list[int]
    plan: Any = field(default=None)  # backend-private precomputation, filled on first use


def build_attention_metadata(
    decodes: Sequence[SeqSpan],
    extends: Sequence[SeqSpan],
    *,
    block_size: int,
    scale: float,
    device: torch.device | str,
) -> AttentionMetadata:
    """Metadata for a step of single-token ``decodes`` followed by ``extends``.

    Raises ValueError if a decode span is not one token or a block table is too short.
    """
    slots: list[int] = []
    for span in (*decodes, *extends):
        end = span.start_pos + span.num_new
        if span.num_new < 1 or len(span.block_ids) * block_size < end:
            raise ValueError(
                f"span of {span.num_new} new tokens at {span.start_pos} needs "
                f"{-(-end // block_size)} blocks, got {len(span.block_ids)}"
            )
        ids = span.block_ids
        slots.extend(
            ids[p // block_size] * block_size + p % block_size for p in range(span.start_pos, end)
        )
    if any(d.num_new != 1 for d in decodes):
        raise ValueError("decode spans must carry exactly one new token")
    seq_lens = [d.start_pos + 1 for d in decodes]
    prefix_lens = [e.start_pos for e in extends]
    ext_lens = [e.num_new for e in extends]
    cu = [0]
    for n in ext_lens:
        cu.append(cu[-1] + n)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        scale=scale,
        num_decode_tokens=len(decodes),
        decode_block_tables=_block_table([d.block_ids for d in decodes], device),
        decode_seq_lens=i32(seq_lens),
        extend_block_tables=_block_table([e.block_ids for e in extends], device),
        extend_prefix_lens=i32(prefix_lens),
        extend_lens=i32(ext_lens),
        cu_extend=i32(cu),
        decode_seq_lens_host=seq_lens,
        extend_prefix_lens_host=prefix_lens,
        extend_lens_host=ext_lens,
    )


def _block_table(tables: list[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    rows = [list(t) + [-1] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(tables), width)


# (x [T, H], weight [H], eps, residual [T, H] | None) -> (normed, x + residual), x's dtype
RMSNormFn = Callable[
    [torch.Tensor, torch.Tensor, float, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]
# (q [T, Hq, D], k [T, Hkv, D], positions [T], cos_sin_cache [P, D]) -> None; rotates in place
RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# gate_up [T, 2I] -> silu(gate) * up [T, I]
SiluMulFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The non-attention ops a kernel backend brings for the model: RMSNorm fused with the
    residual add, RoPE applied to q and k in place, and (if given) SiLU-and-multiply."""

    rms_norm: RMSNormFn
    apply_rope_: RopeFn
    silu_mul: SiluMulFn | None = None


class AttentionBackend(Protocol):
    """Writes this step's K/V into the cache, then attends.

    q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]; rows are ordered decodes first, as in
    :class:`AttentionMetadata`. ``fused_ops`` is None when the model should run its own torch
    norm and RoPE, else the kernels it should run instead.
    """

    fused_ops: FusedOps | None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


def make_backend(
    name: str, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """``auto`` picks Triton on CUDA and, on CPU, ``native`` for float32 (the torch path with its
    decode attention and small ops in C, see :class:`NativeAttention`) when a C compiler is
    there, else ``torch``; ``reference`` runs the kernels' plain-torch references (slow, for
    checking).

    ``triton`` on a CPU runs the kernels through Triton's interpreter, which needs
    ``TRITON_INTERPRET=1`` set before kernels/ is first imported; otherwise ValueError.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    is_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        name = "triton" if is_cuda else _cpu_default(dtype)
    if name == "torch":
        return TorchAttention()
    if name == "native":
        if is_cuda or dtype != torch.float32:
            raise ValueError(f"the native attention backend runs float32 on CPU, not {dtype}")
        return NativeAttention()
    if name == "triton" and not is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton attention backend needs a CUDA device, or TRITON_INTERPRET=1 "
            "(set before kernels/ is imported) to run its kernels on CPU"
        )
    backend = KernelAttention(use_triton=name == "triton")
    if name == "triton" and not is_cuda:
        _check_interpreted(backend.kernel_modules)
    return backend


def _cpu_default(dtype: torch.dtype) -> str:
    from prefixrag.kernels import cpu_ops
    from prefixrag.kernels.native_build import NativeBuildError

    if dtype != torch.float32:
        return "torch"
    try:
        cpu_ops.build()
    except NativeBuildError as err:
        log.warning("C kernels unavailable, attention falls back to torch ops (slower): %s", err)
        return "torch"
    return "native"


def _check_interpreted(modules: Sequence[ModuleType]) -> None:
    import triton

    # triton.jit picks device code or the interpreter when a module is imported, not per call.
    compiled = [
        m.__name__
        for m in modules
        if any(isinstance(v, triton.JITFunction) for v in vars(m).values())
    ]
    if compiled:
        raise ValueError(
            f"{compiled} were imported before TRITON_INTERPRET=1 was set, so their kernels "
            "need a GPU; set the variable before importing kernels/ (or reload them)"
        )


class KernelAttention:
    """Attention through kernels/: the Triton kernels, or their plain-torch references; its
    ``fused_ops`` are the matching RMSNorm and RoPE from kernels/."""

    def __init__(self, *, use_triton: bool) -> None:
        from prefixrag.kernels import extend_attention, kv_write, paged_decode, rms_norm, rope

        self.kernel_modules = (extend_attention, kv_write, paged_decode, rms_norm, rope)
        if use_triton:
            self._write_kv = kv_write.write_kv
            self._decode = paged_decode.paged_decode_attention
            self._extend = extend_attention.extend_attention
            self.fused_ops = FusedOps(rms_norm.rms_norm, rope.apply_rope_)
        else:
            self._write_kv = kv_write.write_kv_reference
            self._decode = paged_decode.paged_decode_attention_reference
            self._extend = extend_attention.extend_attention_reference
            self.fused_ops = FusedOps(rms_norm.rms_norm_reference, rope.apply_rope_reference_)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """See :class:`AttentionBackend`."""
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return self._decode(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, meta.scale
            )
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = self._decode(
                q[:num_decode],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                meta.scale,
            )
        out[num_decode:] = self._extend(
            q[num_decode:],
            k_cache,
            v_cache,
            meta.extend_block_tables,
            meta.extend_prefix_lens,
            meta.extend_lens,
            meta.cu_extend,
            meta.scale,
        )
        return out


def sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, **kwargs: Any
) -> torch.Tensor:
    """SDPA over [..., H, L, D] tensors where K/V may have fewer heads than q (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **kwargs)


@dataclass(slots=True)
class _TorchPlan:
    decode_blocks: torch.Tensor | None  # int64 [Bd, max_blocks]: block table, padded with block 0
    decode_mask: torch.Tensor | None  # bool [Bd, 1, 1, max_blocks * bs]; None when none is padded
    extends: list[
        tuple[int, int, torch.Tensor | None, torch.Tensor | None]
    ]  # start, end, slots, mask


class TorchAttention:
    """The CPU path: gathers each sequence's cached K/V by slot once per step and runs SDPA.

    A prefill with an empty prefix attends over its own new K/V directly, without a gather.
    """

    fused_ops: FusedOps | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """See :class:`AttentionBackend`."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        if meta.plan is None:
            meta.plan = _torch_plan(meta, k_cache.shape[1])
        plan: _TorchPlan = meta.plan
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return _decode_sdpa(q, k_cache, v_cache, plan, meta.scale)
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = _decode_sdpa(q[:num_decode], k_cache, v_cache, plan, meta.scale)
        _extend_sdpa(q, k, v, k_cache, v_cache, plan.extends, meta.scale, out)
        return out


class NativeAttention:
    """The CPU path with C kernels (kernels/cpu_ops), float32 only: the KV write and decode
    attention, which reads the paged cache in place through the block tables; extends
    (prefill) run SDPA as :class:`TorchAttention` does. Its ``fused_ops`` are the C RMSNorm,
    RoPE and SiLU-and-multiply.

    At batch 1 a torch decode step is hundreds of tiny ops, each paying dispatch, and its SDPA
    path copies every cached K/V row before reading it. (Extends stay on SDPA: even a short
    suffix after a long cached prefix is a matrix product there, while the C kernel walks the
    cache once per query row; measured ~2.5x slower for 32 new tokens over 2,048 cached.)
    """

    def __init__(self) -> None:
        from prefixrag.kernels import cpu_ops

        self._ops = cpu_ops
        self.fused_ops = FusedOps(cpu_ops.rms_norm, cpu_ops.apply_rope_, cpu_ops.silu_mul)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """See :class:`AttentionBackend`."""
        self._ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.plan is None:
            meta.plan = _native_plan(meta, k_cache.shape[1])
        decode_rows, extends = meta.plan
        out = self._ops.paged_attention_rows(
            q, k_cache, v_cache, meta.decode_block_tables, decode_rows, decode_rows.int(),
            meta.decode_seq_lens, meta.scale,
        )  # fmt: skip
        if extends:
            _extend_sdpa(q, k, v, k_cache, v_cache, extends, meta.scale, out)
        return out


def _native_plan(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, list]:
    # the decode rows (each attends through its own table row), and each extend's SDPA entry
    decode_rows = torch.arange(meta.num_decode_tokens, device=meta.slot_mapping.device)
    extends = []
    start = meta.num_decode_tokens
    for b, n in enumerate(meta.extend_lens_host):
        extends.append(_extend_entry(meta, b, start, block_size))
        start += n
    return decode_rows, extends


def _extend_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    extends: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]],
    scale: float,
    out: torch.Tensor,
) -> None:
    # rows start:end of q attend over the cache blocks given (None: a fresh prefill over its
    # own new K/V), under an additive mask that hides the future and the last block's padding
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for start, end, blocks, mask in extends:
        # [T, H, D] -> [1, H, T, D]
        q_seq = q[start:end].transpose(0, 1).unsqueeze(0)
        if blocks is None:
            k_seq, v_seq = k[start:end], v[start:end]
        else:
            # whole blocks, as in decode: one contiguous copy each instead of one per slot
            k_seq = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
            v_seq = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
        o = sdpa_gqa(
            q_seq,
            k_seq.transpose(0, 1).unsqueeze(0),
            v_seq.transpose(0, 1).unsqueeze(0),
            scale=scale,
            attn_mask=mask,
            is_causal=blocks is None,
        )
        out[start:end] = o[0].transpose(0, 1)


def _decode_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _TorchPlan, scale: float
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # One new query per sequence: fold each KV head's query group into the query-length axis,
    # so plain SDPA does GQA without repeating K/V. q: [B, Hkv, group, D]; k, v: [B, Hkv, L, D].
    q_g = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # Gather whole blocks (one contiguous copy each), not single slots: a block-sized index list
    # is ~block_size times shorter. index_select, not k_cache[blocks]: advanced indexing is
    # orders of magnitude slower on CPU. Positions past a sequence's length are masked.
    blocks = plan.decode_blocks.view(-1)
    k_seq = k_cache.index_select(0, blocks).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    v_seq = v_cache.index_select(0, blocks).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q_g, k_seq, v_seq, attn_mask=plan.decode_mask, scale=scale)
    return o.reshape(batch, num_heads, head_dim)


def _torch_plan(meta: AttentionMetadata, block_size: int) -> _TorchPlan:
    device = meta.slot_mapping.device
    decode_blocks = decode_mask = None
    if meta.num_decode_tokens:
        lens = meta.decode_seq_lens_host
        num_blocks = -(-max(lens) // block_size)
        decode_blocks = meta.decode_block_tables[:, :num_blocks].long().clamp_min(0)
        width = num_blocks * block_size
        if min(lens) != width:
            pos = torch.arange(width, device=device)
            decode_mask = (pos < meta.decode_seq_lens.unsqueeze(1)).view(len(lens), 1, 1, width)
    extends = []
    start = meta.num_decode_tokens
    for b, n in enumerate(meta.extend_lens_host):
        extends.append(_extend_entry(meta, b, start, block_size))
        start += n
    return _TorchPlan(decode_blocks, decode_mask, extends)


def _extend_entry(
    meta: AttentionMetadata, b: int, start: int, block_size: int
) -> tuple[int, int, torch.Tensor | None, torch.Tensor | None]:
    # extend b's q rows, the cache blocks it attends over (None: no prefix) and its additive
    # causal mask [n, blocks * block_size]; a float mask, built once per step, because SDPA
    # would turn a boolean one into floats again in every layer
    prefix, n = meta.extend_prefix_lens_host[b], meta.extend_lens_host[b]
    if not prefix:
        return start, start + n, None, None
    device = meta.slot_mapping.device
    num_blocks = -(-(prefix + n) // block_size)
    blocks = meta.extend_block_tables[b, :num_blocks].long()
    q_pos = torch.arange(prefix, prefix + n, device=device)
    visible = torch.arange(num_blocks * block_size, device=device) <= q_pos.unsqueeze(1)
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    return start, start + n, blocks, mask
