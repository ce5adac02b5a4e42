"""ScatteredAttention: the sdpa, triton and reference paths agree, write each query's fresh K/V
into its slot before attending, and build_scattered_metadata maps positions to slots."""

from __future__ import annotations

import pytest
import torch

from prefixrag.engine.attention.scattered import (
    ScatteredAttention,
    ScatteredMetadata,
    build_scattered_metadata,
    make_scattered_attention,
)

# tests/conftest.py sets TRITON_INTERPRET=1 without CUDA, so "triton" runs interpreted on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 4
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
SEQ_LEN = 23
BLOCK_IDS = [5, 0, 7, 2, 6, 3, 9]  # 7 blocks of 4 hold 28 >= 23 positions, out of order
POSITIONS = [17, 0, 9, 22, 4, 5, 13]  # unsorted, position 0 included


def _caches(seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shape = (10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return k_cache, v_cache


def _step(seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    n = len(POSITIONS)
    q = torch.randn(n, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    return q, k, v


def _meta() -> ScatteredMetadata:
    return build_scattered_metadata(
        POSITIONS, BLOCK_IDS, block_size=BLOCK_SIZE, scale=HEAD_DIM**-0.5, device=DEVICE
    )


def _naive(q, k_cache, v_cache, scale):
    """float64 over the sequence read position by position (no block gathers, no SDPA)."""
    slots = [BLOCK_IDS[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(SEQ_LEN)]
    group = NUM_Q_HEADS // NUM_KV_HEADS
    keys = k_cache.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].cpu().double()
    values = v_cache.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].cpu().double()
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.cpu().double(), keys) * scale
    visible = torch.arange(SEQ_LEN)[None, :] <= torch.tensor(POSITIONS)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, values)


@pytest.mark.parametrize("impl", ["sdpa", "triton", "reference"])
def test_impls_write_then_attend(impl):
    backend = ScatteredAttention(impl)
    assert backend.fused_ops is None
    meta = _meta()
    q, k, v = _step(1)
    k_cache, v_cache = _caches(0)
    out = backend.forward(q, k, v, k_cache, v_cache, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    # The fresh K/V sit at each position's slot; every other slot is untouched.
    k_before, v_before = _caches(0)
    flat = k_before.view(-1, NUM_KV_HEADS, HEAD_DIM), v_before.view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat[0][meta.slot_mapping], flat[1][meta.slot_mapping] = k, v
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    expected = _naive(q, k_cache, v_cache, meta.scale)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)
    # The query at position 0 sees only its own fresh key, so it returns its own fresh value
    # (for every query head of the KV head's group).
    row = POSITIONS.index(0)
    own_value = v[row].repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=0)
    torch.testing.assert_close(out[row], own_value)


def test_impls_agree_and_the_plan_serves_every_layer():
    meta = _meta()
    backends = {impl: ScatteredAttention(impl) for impl in ("sdpa", "triton", "reference")}
    for layer in range(2):  # two layers: their own caches and fresh K/V, one shared metadata
        q, k, v = _step(10 + layer)
        outs = {}
        for impl, backend in backends.items():
            k_cache, v_cache = _caches(layer)
            outs[impl] = backend.forward(q, k, v, k_cache, v_cache, meta)
        plan = meta.plan
        assert plan is not None
        torch.testing.assert_close(outs["sdpa"], outs["reference"], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(outs["triton"], outs["reference"], atol=2e-5, rtol=2e-5)
    assert meta.plan is plan  # built by the first layer, reused by the second


def test_sdpa_half_precision_matches_reference():
    meta = _meta()
    q, k, v = _step(3, torch.bfloat16)
    outs = []
    for impl in ("sdpa", "reference"):
        k_cache, v_cache = _caches(4, torch.bfloat16)
        outs.append(ScatteredAttention(impl).forward(q, k, v, k_cache, v_cache, meta))
    assert outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0], outs[1], atol=1.6e-2, rtol=1.6e-2)


def test_build_metadata():
    meta = _meta()
    slots = [BLOCK_IDS[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in POSITIONS]
    assert meta.slot_mapping.tolist() == slots and meta.slot_mapping.dtype == torch.int64
    assert meta.q_positions.tolist() == POSITIONS and meta.q_positions.dtype == torch.int64
    assert meta.block_table.tolist() == BLOCK_IDS and meta.block_table.dtype == torch.int32
    assert meta.kv_len == max(POSITIONS) + 1 and meta.plan is None
    # 22 needs 6 blocks of 4; a -1 past them is padding nobody reads.
    build_scattered_metadata([22], [*BLOCK_IDS[:6], -1], block_size=4, scale=1.0, device="cpu")
    with pytest.raises(ValueError, match="needs 6 blocks"):
        build_scattered_metadata([22, 1], BLOCK_IDS[:5], block_size=4, scale=1.0, device="cpu")
    with pytest.raises(ValueError, match=">= 0"):
        build_scattered_metadata([3, -1], BLOCK_IDS, block_size=4, scale=1.0, device="cpu")
    with pytest.raises(ValueError, match="distinct"):
        build_scattered_metadata([3, 3], BLOCK_IDS, block_size=4, scale=1.0, device="cpu")
    with pytest.raises(ValueError, match="block_ids"):
        build_scattered_metadata([5], [1, -1], block_size=4, scale=1.0, device="cpu")


def test_empty_step():
    meta = build_scattered_metadata([], BLOCK_IDS, block_size=4, scale=1.0, device=DEVICE)
    assert meta.kv_len == 0
    empty = torch.empty(0, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    q = torch.empty(0, NUM_Q_HEADS, HEAD_DIM, device=DEVICE)
    for impl in ("sdpa", "triton", "reference"):
        out = ScatteredAttention(impl).forward(q, empty, empty, *_caches(0), meta)
        assert out.shape == q.shape


def test_make_scattered_attention():
    assert make_scattered_attention("auto", "cpu").impl == "sdpa"
    assert make_scattered_attention("triton", "cpu").impl == "sdpa"
    assert make_scattered_attention("reference", "cpu").impl == "reference"
    assert make_scattered_attention("auto", "cuda").impl == "triton"
    assert make_scattered_attention("torch", "cuda").impl == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_scattered_attention("flash", "cpu")
    with pytest.raises(ValueError, match="unknown scattered attention impl"):
        ScatteredAttention("flash")
