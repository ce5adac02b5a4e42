"""KV write: reference vs plain per-token indexing, Triton vs reference (bit-exact)."""

import pytest
import torch

from prefixrag.kernels.kv_write import write_kv, write_kv_reference
from tests.kernels.paged_batch import requires_gpu


def _case(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, device, dtype=torch.float32):
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::3] = -1  # padding tokens
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(device)
    return k, v, k_cache, k_cache.clone().neg(), slots.to(device)


@pytest.mark.parametrize("block_size", [8, 16, 5])
def test_reference_writes_each_slot(block_size):
    k, v, k_cache, v_cache, slots = _case(11, 2, 64, block_size, 4, "cpu")
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot // block_size, slot % block_size] = k[t]
            v_expected[slot // block_size, slot % block_size] = v[t]
    write_kv_reference(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 128), (8, 48)])
@pytest.mark.parametrize(("num_tokens", "block_size"), [(1, 8), (17, 16), (40, 32), (0, 8)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_triton_matches_reference(
    device, num_kv_heads, head_dim, num_tokens, block_size, slot_dtype
):
    k, v, k_cache, v_cache, slots = _case(num_tokens, num_kv_heads, head_dim, block_size, 3, device)
    slots = slots.to(slot_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots)
    write_kv_reference(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_bad_input_raises():
    k, v, k_cache, v_cache, slots = _case(4, 2, 64, 8, 2, "cpu")
    with pytest.raises(ValueError, match="slots outside"):
        write_kv_reference(k, v, k_cache, v_cache, slots + 100)
    with pytest.raises(ValueError, match="slot_mapping has 3 slots"):
        write_kv(k, v, k_cache, v_cache, slots[:3])
    with pytest.raises(ValueError, match="cache holds"):
        write_kv(k[:, :1], v[:, :1], k_cache, v_cache, slots)


@pytest.mark.gpu
@requires_gpu
def test_gpu_large():
    k, v, k_cache, v_cache, slots = _case(8192, 8, 128, 16, 1024, "cuda", torch.bfloat16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots)
    write_kv_reference(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
