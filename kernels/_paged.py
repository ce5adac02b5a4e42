"""Plain-torch helpers that read a paged KV cache through block tables, for the references."""

from __future__ import annotations

import torch


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the first ``num_tokens`` K/V rows of each sequence, contiguous.

    block_tables is [B, max_blocks]; the result is [B, num_tokens, Hkv, D]. Rows past a sequence's
    own length come from whatever block the table names there (clamped to block 0 for -1 padding):
    callers mask them.
    """
    block_size = k_cache.shape[1]
    if num_tokens > block_tables.shape[1] * block_size:
        raise ValueError(
            f"block_tables hold {block_tables.shape[1]} blocks of {block_size} tokens, "
            f"too few for {num_tokens} tokens"
        )
    num_blocks = -(-num_tokens // block_size)
    # Whole-block copies along dim 0 are far cheaper than a per-token (block, offset) gather.
    # -1 marks table padding; any valid id works there because those rows are masked out.
    block_ids = block_tables[:, :num_blocks].long().clamp_min(0)
    k = k_cache[block_ids].flatten(1, 2)[:, :num_tokens]
    v = v_cache[block_ids].flatten(1, 2)[:, :num_tokens]
    return k, v
