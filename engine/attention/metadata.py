"""Per-step attention metadata: index tensors built once per step and shared by every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


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
