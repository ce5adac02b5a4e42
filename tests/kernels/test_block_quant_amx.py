"""The AMX path for prefill-sized block matmuls (csrc/amx_matmul.h) against float64 over the
dequantized matrix, for every block kind, and its claims: float32 accuracy, and a row's result
the same whatever shares its call or however many threads run."""

from __future__ import annotations

import pytest
import torch

from prefixrag.kernels.block_quant_matmul import (
    BlockQuantWeight,
    amx_ready,
    block_quant_matmul_amx,
)
from prefixrag.kernels.block_quant_reference import (
    dequantize_torch,
)
from prefixrag.kernels.native_build import DEFAULT_FLAGS

needs_amx = pytest.mark.skipif(not amx_ready(), reason="the host has no AMX-BF16")


def random_weight(kind: str, n: int, k: int, seed: int) -> BlockQuantWeight:
    gen = torch.Generator().manual_seed(seed)
    per = 16 if kind == "q8_16" else 32
    d = torch.rand(n, k // per, generator=gen) / 50  # float32 scales, all 24 bits in use
    if kind == "q4":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    m = -8 * d * torch.rand(n, k // 32, generator=gen) if kind in ("q4", "q8m") else None
    return BlockQuantWeight(kind, codes, d, m)


def relative_error(got: torch.Tensor, x: torch.Tensor, w: BlockQuantWeight) -> float:
    """max |got - x W^T| over max of |x| |W|^T, W the dequantized matrix, in float64"""
    dense = dequantize_torch(w).double()
    want = x.double() @ dense.T
    scale = x.double().abs() @ dense.abs().T
    return float(((got.double() - want).abs() / scale).max())


@needs_amx
@pytest.mark.parametrize("kind", ["q4", "q8", "q8_16", "q8m"])
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(17, 48, 576), (32, 50, 96), (20, 24, 32), (33, 16, 32), (64, 35, 1536)],
)
def test_every_kind_matches_float64_to_float32_accuracy(kind, rows, n, k):
    # rows past one tile and past a pair of tiles (up to a pair, each chunk is packed as the
    # products reach it; past it, a panel's chunks first), weight rows past whole tiles of 16,
    # one chunk of K and many; x over four decades, so every part of it matters
    w = random_weight(kind, n, k, seed=rows + n)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)
    got = block_quant_matmul_amx(x, w)
    # a float32 dot of K terms errs by about sqrt(K) ulps; dropping x's or w's third part would
    # err by 2^-17 (7.6e-6) of the terms, about 30 times this bound at K = 1,536
    assert relative_error(got, x, w) < 4 * k**0.5 * 2.0**-24


@needs_amx
def test_a_row_gets_the_same_bits_whatever_shares_its_call_and_however_many_threads():
    w = random_weight("q4", 70, 192, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 192, generator=gen)
    whole = block_quant_matmul_amx(x, w)  # two pairs of tiles: the panel packed first
    assert torch.equal(block_quant_matmul_amx(x[7:27], w), whole[7:27])  # one: chunk by chunk
    assert torch.equal(block_quant_matmul_amx(x[21:], w), whole[21:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = block_quant_matmul_amx(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, whole)


def test_a_build_without_amx_says_so_and_refuses():
    flags = (*DEFAULT_FLAGS, "-mno-amx-bf16")
    assert not amx_ready(flags)
    w = random_weight("q4", 16, 64, seed=5)
    with pytest.raises(ValueError, match="no AMX"):
        block_quant_matmul_amx(torch.randn(20, 64), w, flags)
