"""Position-independent reuse of cached chunk KV, with selective recompute (CacheBlend).

A prompt's reused bodies get their cached K/V copied into the sequence's own slots, keys
re-rotated from the position they were computed at to the new one (RoPE is a rotation, so
``R(new) = R(new - old) R(old)``). Their KV lacks attention to whatever now precedes them, so:

1. layers ``0 .. select_layer`` run over every new token, as in plain prefill (their KV is
   written fresh over the reused copy);
2. at ``select_layer`` the fresh K/V of each reused token is compared with its reused K/V, and
   only the ``fraction`` that deviate most are recomputed in the later layers, together with
   every token that had nothing to reuse (headers, the question, uncached bodies);
3. the later layers run only those rows: queries at scattered positions over the paged cache,
   where the other tokens' reused K/V stands in for theirs.

At ``fraction`` 1.0 every row is recomputed in every layer: plain prefill, up to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixrag.engine.attention.backend import AttentionBackend
from prefixrag.engine.attention.metadata import AttentionMetadata
from prefixrag.engine.chunks.reuse_plan import ReuseHit
from prefixrag.engine.model import ForwardContext, LlamaModel
from prefixrag.engine.quant import embedding


def rerotate_keys(k: torch.Tensor, delta: int, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Keys rotated (rotate-half RoPE) at positions p, turned into keys at p + ``delta``.

    k: [..., D]; ``cos_sin_cache`` is the model's ``cat(cos, sin)`` table [P, D].
    """
    if delta == 0:
        return k
    half = k.shape[-1] // 2
    row = cos_sin_cache[abs(delta)]
    cos, sin = row[:half], row[half:] * (1 if delta > 0 else -1)  # sin(-x) = -sin(x)
    kf = k.float()
    x1, x2 = kf[..., :half], kf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(k.dtype)


def slots_of(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of ``positions`` in a table of ``block_ids`` (int64)."""
    return block_ids[positions // block_size] * block_size + positions % block_size


def place_reused_kv(
    kv_pool: torch.Tensor,
    hits: list[ReuseHit],
    dst_block_ids: list[int],
    *,
    first_layer: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Copy each hit's cached K/V (layers ``first_layer`` on) into the sequence's slots at its
    new position, keys re-rotated. ``kv_pool``: [2, layers, blocks, block_size, Hkv, D]."""
    _, num_layers, num_blocks, block_size = kv_pool.shape[:4]
    flat = kv_pool.view(2, num_layers, num_blocks * block_size, *kv_pool.shape[4:])
    device = kv_pool.device
    dst_table = torch.tensor(dst_block_ids, dtype=torch.int64, device=device)
    for hit in hits:
        offsets = torch.arange(hit.num_tokens, device=device)
        src_table = torch.tensor(hit.block_ids, dtype=torch.int64, device=device)
        src = slots_of(src_table, offsets, block_size)
        dst = slots_of(dst_table, offsets + hit.start, block_size)
        k = flat[0, first_layer:].index_select(1, src)  # [L', n, Hkv, D]
        v = flat[1, first_layer:].index_select(1, src)
        k = rerotate_keys(k, hit.start - hit.base_pos, cos_sin_cache)
        flat[0, first_layer:].index_copy_(1, dst, k)
        flat[1, first_layer:].index_copy_(1, dst, v)


def copy_slots(
    kv_pool: torch.Tensor,
    src_block_ids: list[int],
    src_start: int,
    num_tokens: int,
    dst_block_ids: list[int],
) -> None:
    """Copy the K/V of ``num_tokens`` tokens from ``src_start`` in one table to the start of
    another, in every layer (a chunk body into its own store entry)."""
    _, num_layers, num_blocks, block_size = kv_pool.shape[:4]
    flat = kv_pool.view(2, num_layers, num_blocks * block_size, *kv_pool.shape[4:])
    device = kv_pool.device
    offsets = torch.arange(num_tokens, device=device)
    src_table = torch.tensor(src_block_ids, dtype=torch.int64, device=device)
    dst_table = torch.tensor(dst_block_ids, dtype=torch.int64, device=device)
    src = slots_of(src_table, offsets + src_start, block_size)
    dst = slots_of(dst_table, offsets, block_size)
    flat.index_copy_(2, dst, flat.index_select(2, src))


def read_entry_kv(
    kv_pool: torch.Tensor, block_ids: list[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An entry's K and V as new tensors [layers, num_tokens, Hkv, D] (for the slower tiers)."""
    _, num_layers, num_blocks, block_size = kv_pool.shape[:4]
    flat = kv_pool.view(2, num_layers, num_blocks * block_size, *kv_pool.shape[4:])
    table = torch.tensor(block_ids, dtype=torch.int64, device=kv_pool.device)
    slots = slots_of(table, torch.arange(num_tokens, device=kv_pool.device), block_size)
    kv = flat.index_select(2, slots)
    return kv[0], kv[1]


def write_entry_kv(
    kv_pool: torch.Tensor, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
) -> None:
    """Fill an entry's blocks with K and V [layers, num_tokens, Hkv, D] from a slower tier."""
    _, num_layers, num_blocks, block_size = kv_pool.shape[:4]
    flat = kv_pool.view(2, num_layers, num_blocks * block_size, *kv_pool.shape[4:])
    device = kv_pool.device
    table = torch.tensor(block_ids, dtype=torch.int64, device=device)
    slots = slots_of(table, torch.arange(k.shape[1], device=device), block_size)
    flat[0].index_copy_(1, slots, k.to(device=device, dtype=kv_pool.dtype))
    flat[1].index_copy_(1, slots, v.to(device=device, dtype=kv_pool.dtype))


class DeviationProbe:
    """An attention backend wrapper that, before the step's K/V overwrite the cache, measures
    how far each token's fresh K/V lie from what the cache held (the reused copy)."""

    fused_ops = None

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.deviation: torch.Tensor | None = None  # float32 [T]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        slots = meta.slot_mapping
        old_k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).float()
        old_v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).float()
        # relative, so that tokens with large activations do not win for their size alone
        dk = (k.float() - old_k).norm(dim=(1, 2)) / old_k.norm(dim=(1, 2)).clamp_min(1e-6)
        dv = (v.float() - old_v).norm(dim=(1, 2)) / old_v.norm(dim=(1, 2)).clamp_min(1e-6)
        self.deviation = dk + dv
        return self.inner.forward(q, k, v, k_cache, v_cache, meta)


def choose_recompute(
    deviation: torch.Tensor, reused: torch.Tensor, fraction: float
) -> torch.Tensor:
    """Rows to carry on with, ascending: every row not ``reused``, and the ``ceil(fraction *
    reused)`` reused rows of largest ``deviation``."""
    num_reused = int(reused.sum())
    num_pick = min(num_reused, math.ceil(fraction * num_reused - 1e-9))
    keep = ~reused
    if num_pick:
        masked = deviation.masked_fill(~reused, float("-inf"))
        keep = keep.clone()
        keep[torch.topk(masked, num_pick).indices] = True
    return keep.nonzero().squeeze(1)


@dataclass(slots=True)
class BlendResult:
    """The final hidden state of the last new token, and how many reused rows were recomputed."""

    last_hidden: torch.Tensor  # [1, hidden]
    num_recomputed: int


def blend_forward(
    model: LlamaModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    reused: torch.Tensor,
    ctx: ForwardContext,
    scattered_ctx: Callable[[torch.Tensor], ForwardContext],
    *,
    fraction: float,
    select_layer: int,
) -> BlendResult:
    """The blended prefill of one sequence's new tokens (see the module docstring).

    ``ctx`` attends as plain prefill over every new token; ``scattered_ctx(rows)`` makes the
    context of the later layers, whose queries are only ``rows`` of the new tokens. ``reused``
    marks the rows whose K/V were placed from the store (bool [T]); the last row must not be
    one of them.
    """
    if bool(reused[-1]):
        raise ValueError("the last new token must be computed: it gives the logits")
    select_layer = min(select_layer, len(model.layers) - 1)
    rope = model.make_rope(model.cos_sin_cache, positions)
    x = embedding(input_ids, model.embed_weight)
    residual: torch.Tensor | None = None
    for layer in model.layers[:select_layer]:
        x, residual = layer(x, residual, rope, ctx)
    probe = DeviationProbe(ctx.backend)
    probe_ctx = ForwardContext(probe, ctx.metadata, ctx.kv_caches)
    x, residual = model.layers[select_layer](x, residual, rope, probe_ctx)
    assert probe.deviation is not None and residual is not None
    rows = choose_recompute(probe.deviation, reused, fraction)
    x, residual = x.index_select(0, rows), residual.index_select(0, rows)
    later = model.layers[select_layer + 1 :]
    if len(later):
        sub_positions = positions.index_select(0, rows)
        sub_rope = model.make_rope(model.cos_sin_cache, sub_positions)
        sub_ctx = scattered_ctx(rows)
        for layer in later:
            x, residual = layer(x, residual, sub_rope, sub_ctx)
    num_recomputed = int(reused.index_select(0, rows).sum())
    return BlendResult((x + residual)[-1:], num_recomputed)
