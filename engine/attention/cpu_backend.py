"""The C backend on CPU (the ``native`` attention setting): kernels/cpu_ops, float32 only."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixrag.engine.attention.backend import FusedOps
from prefixrag.engine.attention.metadata import AttentionMetadata
from prefixrag.engine.attention.sdpa import ExtendEntry, extend_entry, extend_sdpa

# Extends of up to this many rows after a cached prefix run the C tile kernel; longer ones, and
# fresh prefills, run SDPA. Past it both are compute-bound and level, but SDPA must first gather
# and widen the whole prefix for every layer, which a short extend (a new question after cached
# documents) pays in full for a few rows of work (bench/extend_attention_bench.py).
TILE_MAX_ROWS = 128
# Extends of at most this many rows (a fully cached prompt recomputes its last token) run the
# decode kernel row by row instead: it splits one row's positions across threads, where the
# tile kernel would give a thread a whole tile of mostly absent rows.
ROWS_MAX_ROWS = 2


class NativeAttention:
    """The CPU path with C kernels (kernels/cpu_ops), float32 only: the KV write, decode
    attention and the attention of short extends after a cached prefix, which read the paged
    cache in place through the block tables; fresh prefills and long extends run SDPA as
    :class:`TorchAttention` does. Its ``fused_ops`` are the C RMSNorm, RoPE and
    SiLU-and-multiply.

    At batch 1 a torch decode step is hundreds of tiny ops, each paying dispatch, and its SDPA
    path copies every cached K/V row before reading it. A short extend's rows share each chunk
    of cached positions in the tile kernel (csrc/extend_tiles.h), where the per-row decode
    kernel would reread the prefix once per row.
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
        plan: CpuPlan = meta.plan
        out = self._ops.paged_attention_rows(
            q, k_cache, v_cache, meta.decode_block_tables, plan.decode_rows,
            plan.decode_rows.int(), meta.decode_seq_lens, meta.scale,
        )  # fmt: skip
        if plan.by_row is not None:
            ids, seqs, lens = plan.by_row
            self._ops.paged_attention_rows(
                q, k_cache, v_cache, meta.extend_block_tables, ids, seqs, lens, meta.scale, out
            )
        if plan.tiled is not None:
            tables, starts, prefixes, lens = plan.tiled
            self._ops.paged_extend_attention(
                q, k_cache, v_cache, tables, starts, prefixes, lens, meta.scale, out
            )
        if plan.sdpa:
            extend_sdpa(q, k, v, k_cache, v_cache, plan.sdpa, meta.scale, out)
        return out


@dataclass(slots=True)
class CpuPlan:
    """One step's attention work, built once and shared by every layer."""

    decode_rows: torch.Tensor  # int64 [Bd]: each decode row attends through its own table row
    # the short extends after a prefix, for the tile kernel: their block tables, first q rows,
    # prefix lengths and lengths (None: no such extend)
    tiled: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    # the shortest extends' rows for the decode kernel: q row ids, extend indices (rows of the
    # extend block tables) and how many positions each row sees (None: no such extend)
    by_row: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    sdpa: list[ExtendEntry]  # the other extends' SDPA entries


def _cpu_plan(meta: AttentionMetadata, block_size: int) -> CpuPlan:
    device = meta.slot_mapping.device
    decode_rows = torch.arange(meta.num_decode_tokens, device=device)
    tiled: list[tuple[int, int, int, int]] = []
    by_row: list[tuple[int, int, int]] = []
    sdpa, start = [], meta.num_decode_tokens
    for b, (prefix, n) in enumerate(
        zip(meta.extend_prefix_lens_host, meta.extend_lens_host, strict=True)
    ):
        if prefix and n <= ROWS_MAX_ROWS:
            by_row.extend((start + r, b, prefix + r + 1) for r in range(n))
        elif prefix and n <= TILE_MAX_ROWS:
            tiled.append((b, start, prefix, n))
        else:
            sdpa.append(extend_entry(meta, b, start, block_size))
        start += n

    def tensor(values: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    tiled_args = None
    if tiled:
        rows, starts, prefixes, lens = zip(*tiled, strict=True)
        tiled_args = (
            meta.extend_block_tables[tensor(rows, torch.int64)],
            tensor(starts, torch.int64),
            tensor(prefixes, torch.int32),
            tensor(lens, torch.int32),
        )
    by_row_args = None
    if by_row:
        ids, seqs, seen = zip(*by_row, strict=True)
        by_row_args = (
            tensor(ids, torch.int64),
            tensor(seqs, torch.int32),
            tensor(seen, torch.int32),
        )
    return CpuPlan(decode_rows, tiled_args, by_row_args, sdpa)
