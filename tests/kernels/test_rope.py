"""RoPE: cos/sin table and rotation vs Hugging Face's Llama implementation; Triton vs reference."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from prefixrag.kernels.rope import apply_rope_, apply_rope_reference_, build_cos_sin_cache
from tests.kernels.paged_batch import assert_close, requires_gpu

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _hf_cos_sin(head_dim, theta, scaling, positions):
    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        max_position_embeddings=1024,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    emb = LlamaRotaryEmbedding(config)
    return emb(torch.zeros(1, len(positions), head_dim), positions[None, :])


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_hugging_face(scaling, head_dim):
    positions = torch.tensor([0, 1, 7, 63, 64, 500, 1023])
    cache = build_cos_sin_cache(head_dim, 1024, 500000.0, scaling)
    cos, sin = _hf_cos_sin(head_dim, 500000.0, scaling, positions)
    q = torch.randn(len(positions), 6, head_dim)
    k = torch.randn(len(positions), 2, head_dim)
    # HF wants [batch, heads, tokens, dim].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    apply_rope_reference_(q, k, positions, cache)
    assert_close(q, q_hf[0].transpose(0, 1), torch.float32)
    assert_close(k, k_hf[0].transpose(0, 1), torch.float32)


@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])
def test_triton_matches_reference(device, head_dim, num_q_heads, num_kv_heads):
    cache = build_cos_sin_cache(head_dim, 100, 10000.0, device=device)
    positions = torch.tensor([0, 3, 99, 7, 7, 50, 1], device=device)
    q = torch.randn(len(positions), num_q_heads, head_dim, device=device)
    k = torch.randn(len(positions), num_kv_heads, head_dim, device=device)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rope_(q, k, positions, cache)
    apply_rope_reference_(q_ref, k_ref, positions, cache)
    assert_close(q, q_ref, torch.float32)
    assert_close(k, k_ref, torch.float32)


def test_triton_on_strided_views(device):
    # q and k as views into one fused qkv projection, as a model produces them.
    cache = build_cos_sin_cache(64, 32, 10000.0, device=device)
    qkv = torch.randn(5, 6 + 2 + 2, 64, device=device)
    expected = qkv.clone()
    positions = torch.arange(5, device=device)
    apply_rope_(qkv[:, :6], qkv[:, 6:8], positions, cache)
    apply_rope_reference_(expected[:, :6], expected[:, 6:8], positions, cache)
    assert_close(qkv, expected, torch.float32)


def test_bad_input_raises():
    cache = build_cos_sin_cache(64, 10, 10000.0)
    q, k = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="positions must lie"):
        apply_rope_reference_(q, k, torch.tensor([0, 1, 10]), cache)
    with pytest.raises(ValueError, match="head dims"):
        apply_rope_(q, k[..., :32], torch.tensor([0, 1, 2]), cache)
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        build_cos_sin_cache(64, 10, 10000.0, {"rope_type": "yarn", "factor": 2.0})


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large(dtype):
    cache = build_cos_sin_cache(128, 8192, 500000.0, SCALINGS["llama3"], device="cuda")
    positions = torch.randint(0, 8192, (4000,), device="cuda")
    q = torch.randn(4000, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(4000, 8, 128, device="cuda", dtype=dtype)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rope_(q, k, positions, cache)
    apply_rope_reference_(q_ref, k_ref, positions, cache)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
