"""Test helpers: random paged KV batches built by plain indexing, and a naive float64 attention over
the contiguous (un-paged) K/V, independent of the kernels' references."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (atol, rtol) per dtype. fp32 runs on the CPU interpreter, or on CUDA when there is one: the
# kernels ask tl.dot for IEEE fp32 products there (kernels/_precision.py), not TF32 (~1e-3), so
# fp32 tolerances hold on both (tests/kernels/test_dot_precision.py checks the compiled PTX).
# Half types run on a GPU.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass(slots=True)
class PagedBatch:
    """Per-sequence contiguous K/V and the same data scattered into a paged cache."""

    keys: list[torch.Tensor]  # each [L_b, Hkv, D]
    values: list[torch.Tensor]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with `pad`


def make_paged_batch(
    lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    pad: int = -1,
    extra_blocks: int = 1,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V of the given lengths placed in shuffled blocks of a cache with spare blocks
    (filled with large garbage, so reading a wrong slot shows up)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 1e4, dtype=dtype)
    v_cache = torch.full(shape, -1e4, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq, default=0) + extra_blocks
    block_tables = torch.full((len(lens), max_blocks), pad, dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, n in enumerate(lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        ids = order[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_tables[b, : len(ids)] = ids.int()
        for i in range(len(ids)):
            rows = slice(i * block_size, min((i + 1) * block_size, n))
            k_cache[ids[i], : rows.stop - rows.start] = k[rows]
            v_cache[ids[i], : rows.stop - rows.start] = v[rows]
        keys.append(k.to(device))
        values.append(v.to(device))
    return PagedBatch(keys, values, k_cache.to(device), v_cache.to(device), block_tables.to(device))


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float
) -> torch.Tensor:
    """float64 softmax attention: q [E, Hq, D] at positions first_pos.. over k, v [L, Hkv, D];
    query i sees keys 0..first_pos + i. Returns [E, Hq, D] in float64."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("ehd,lhd->hel", q.double(), k64) * scale
    visible = torch.arange(k.shape[0])[None, :] <= first_pos + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hel,lhd->ehd", scores.softmax(dim=-1), v64)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare within the tolerance of ``dtype``."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)
