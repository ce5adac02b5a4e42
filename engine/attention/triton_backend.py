"""The kernel backend: the Triton kernels of kernels/ (``triton``), or their plain-torch
references (``reference``, slow, for checking), each with the matching fused ops."""

from __future__ import annotations

import torch

from prefixrag.engine.attention.backend import FusedOps
from prefixrag.engine.attention.metadata import AttentionMetadata


class KernelAttention:
    """Attention through kernels/: the Triton kernels, or their plain-torch references; its
    ``fused_ops`` are the matching RMSNorm and RoPE from kernels/."""

    def __init__(self, *, use_triton: bool) -> None:
        from prefixrag.kernels import extend_attention, kv_write, paged_decode, rms_norm, rope

        self.kernel_modules = (extend_attention, kv_write, paged_decode, rms_norm, rope)
        self._use_triton = use_triton
        # Triton launches never read device values on the host, so a step can be captured
        self.graph_safe = use_triton
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
        # The Triton kernel sizes its grid by the longest extend: from the host copy of the
        # lengths it needs no device sync, in every layer of the step.
        host = {"max_extend_len": max(meta.extend_lens_host)} if self._use_triton else {}
        out[num_decode:] = self._extend(
            q[num_decode:],
            k_cache,
            v_cache,
            meta.extend_block_tables,
            meta.extend_prefix_lens,
            meta.extend_lens,
            meta.cu_extend,
            meta.scale,
            **host,
        )
        return out
