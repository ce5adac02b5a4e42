"""The C backend on CPU (the ``native`` attention setting): kernels/cpu_ops, float32 only."""

from __future__ import annotations

import torch

from prefixrag.engine.attention.backend import FusedOps
from prefixrag.engine.attention.metadata import AttentionMetadata
from prefixrag.engine.attention.sdpa import ExtendEntry, extend_sdpa, plan_extends


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
            meta.plan = _cpu_plan(meta, k_cache.shape[1])
        decode_rows, extends = meta.plan
        out = self._ops.paged_attention_rows(
            q, k_cache, v_cache, meta.decode_block_tables, decode_rows, decode_rows.int(),
            meta.decode_seq_lens, meta.scale,
        )  # fmt: skip
        if extends:
            extend_sdpa(q, k, v, k_cache, v_cache, extends, meta.scale, out)
        return out


def _cpu_plan(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, list[ExtendEntry]]:
    # the decode rows (each attends through its own table row), and each extend's SDPA entry
    decode_rows = torch.arange(meta.num_decode_tokens, device=meta.slot_mapping.device)
    return decode_rows, plan_extends(meta, block_size)
