"""Prefix-prefill attention: reference vs naive float64 attention, Triton vs reference."""

import pytest
import torch

from prefixrag.kernels.extend_attention import extend_attention, extend_attention_reference
from tests.kernels.paged_batch import assert_close, make_paged_batch, naive_attention, requires_gpu

GQA = [(2, 2), (6, 2), (8, 1)]  # (q heads, kv heads): ratios 1, 3, 8
# (prefix_len, extend_len) per sequence, with block size 8 in mind.
COMPOSITIONS = {
    "empty_prefix": [(0, 5)],
    "prefix_mid_block": [(13, 7)],
    "prefix_on_boundary": [(16, 16)],
    "single_new_token": [(29, 1)],
    "mixed": [(0, 1), (21, 9), (8, 0), (3, 30)],
    "mixed_long_new": [(5, 37), (0, 17), (40, 2)],
}


def _extend_case(pairs, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype, pad=-1):
    lens = [p + e for p, e in pairs]
    batch = make_paged_batch(lens, num_kv_heads, head_dim, block_size, dtype, device, pad=pad)
    extend_lens = torch.tensor([e for _, e in pairs], dtype=torch.int32)
    cu_extend = torch.zeros(len(pairs) + 1, dtype=torch.int32)
    cu_extend[1:] = extend_lens.cumsum(0)
    q = torch.randn(int(cu_extend[-1]), num_q_heads, head_dim).to(dtype).to(device)
    lengths = (
        torch.tensor([p for p, _ in pairs], dtype=torch.int32, device=device),
        extend_lens.to(device),
        cu_extend.to(device),
    )
    return batch, q, lengths


def _naive(batch, q, pairs, scale):
    rows, start = [], 0
    for b, (prefix_len, extend_len) in enumerate(pairs):
        q_new = q[start : start + extend_len]
        rows.append(naive_attention(q_new, batch.keys[b], batch.values[b], prefix_len, scale))
        start += extend_len
    return torch.cat(rows)


def _args(batch, q, lengths, scale):
    return (q, batch.k_cache, batch.v_cache, batch.block_tables, *lengths, scale)


@pytest.mark.parametrize("pairs", COMPOSITIONS.values(), ids=COMPOSITIONS.keys())
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("block_size", [8, 3])
def test_reference_matches_naive(pairs, num_q_heads, num_kv_heads, block_size):
    batch, q, lengths = _extend_case(
        pairs, num_q_heads, num_kv_heads, 32, block_size, "cpu", torch.float32
    )
    out = extend_attention_reference(*_args(batch, q, lengths, 0.2))
    assert_close(out, _naive(batch, q, pairs, 0.2), torch.float32)


@pytest.mark.parametrize("pairs", COMPOSITIONS.values(), ids=COMPOSITIONS.keys())
@pytest.mark.parametrize(("block_size", "pad"), [(8, -1), (16, 0)])
def test_triton_matches_reference_compositions(device, pairs, block_size, pad):
    batch, q, lengths = _extend_case(pairs, 6, 2, 64, block_size, device, torch.float32, pad)
    args = _args(batch, q, lengths, 0.125)
    assert_close(extend_attention(*args), extend_attention_reference(*args), torch.float32)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), GQA)
def test_triton_matches_reference_heads(device, head_dim, num_q_heads, num_kv_heads):
    pairs = COMPOSITIONS["mixed_long_new"]
    batch, q, lengths = _extend_case(
        pairs, num_q_heads, num_kv_heads, head_dim, 8, device, torch.float32
    )
    args = _args(batch, q, lengths, head_dim**-0.5)
    assert_close(extend_attention(*args), _naive(batch, q, pairs, head_dim**-0.5), torch.float32)


@pytest.mark.slow
def test_triton_long_prefix(device):
    pairs = [(300, 70), (0, 129), (257, 1)]
    batch, q, lengths = _extend_case(pairs, 24, 8, 128, 16, device, torch.float32)
    args = _args(batch, q, lengths, 128**-0.5)
    assert_close(extend_attention(*args), extend_attention_reference(*args), torch.float32)


def test_bad_input_raises():
    pairs = [(3, 4), (0, 2)]
    batch, q, (prefix_lens, extend_lens, cu_extend) = _extend_case(
        pairs, 4, 2, 64, 8, "cpu", torch.float32
    )
    base = (q, batch.k_cache, batch.v_cache, batch.block_tables)
    with pytest.raises(ValueError, match="B\\+1"):
        extend_attention(*base, prefix_lens, extend_lens, cu_extend[:-1], 0.1)
    # Right ends (0 and T=6) but steps that disagree with extend_lens (4, 2).
    wrong_steps = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="running sum"):
        extend_attention_reference(*base, prefix_lens, extend_lens, wrong_steps, 0.1)
    with pytest.raises(ValueError, match="int32 or int64"):
        extend_attention(*base, prefix_lens.float(), extend_lens, cu_extend, 0.1)
    with pytest.raises(ValueError, match="v_cache"):
        extend_attention(
            q,
            batch.k_cache,
            batch.v_cache[:-1],
            batch.block_tables,
            prefix_lens,
            extend_lens,
            cu_extend,
            0.1,
        )


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large(dtype):
    pairs = [(1000, 300), (0, 513), (4095, 1), (17, 2000)]
    batch, q, lengths = _extend_case(pairs, 32, 8, 128, 16, "cuda", dtype)
    args = _args(batch, q, lengths, 128**-0.5)
    assert_close(extend_attention(*args), extend_attention_reference(*args), dtype)


@pytest.mark.parametrize("pairs", COMPOSITIONS.values(), ids=COMPOSITIONS.keys())
def test_host_max_extend_len_gives_identical_output(device, pairs, monkeypatch):
    batch, q, lengths = _extend_case(pairs, 6, 2, 64, 8, device, torch.float32)
    args = _args(batch, q, lengths, 0.125)
    synced = extend_attention(*args)

    def no_sync(*_args, **_kwargs):
        raise AssertionError("extend_lens was read on the host")

    # With the host value the wrapper never reads extend_lens back (one sync per layer).
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "max", no_sync)
        host = extend_attention(*args, max_extend_len=max(e for _, e in pairs))
    assert torch.equal(host, synced)
    with pytest.raises(ValueError, match="max_extend_len"):
        extend_attention(*args, max_extend_len=-1)


@pytest.mark.gpu
@requires_gpu
def test_host_max_extend_len_needs_no_sync_on_gpu():
    pairs = COMPOSITIONS["mixed_long_new"]
    batch, q, lengths = _extend_case(pairs, 8, 2, 128, 16, "cuda", torch.bfloat16)
    args = _args(batch, q, lengths, 128**-0.5)
    expected = extend_attention(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = extend_attention(*args, max_extend_len=max(e for _, e in pairs))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, expected)
