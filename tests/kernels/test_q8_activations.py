"""Block weights against int8 activations (csrc/q8_act.h): the native build (VNNI or AVX2), the
AVX2 build and the portable one give the same bits, each row's result is independent of its
batch, and all match a float64 reference over the same quantized activations to float32
rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixrag.kernels.block_quant_matmul import (
    block_quant_matmul,
    q8_activations_fast,
)
from prefixrag.kernels.block_quant_reference import (
    block_quant_matmul_q8a_torch,
    block_quant_matmul_torch,
    quantize_activations_torch,
)
from prefixrag.kernels.gguf_planes import from_gguf_blocks
from tests.kernels.test_block_quant_matmul import ALL_FLAGS, random_gguf_blocks
from tests.kernels.test_block_quant_matmul import AVX2_FLAGS as AVX2
from tests.kernels.test_block_quant_matmul import PORTABLE_FLAGS as PORTABLE

# every kind: q4 (Q4_1, Q4_K), q8 (Q8_0), q8_16 (Q6_K), q8m (Q5_1); K with an odd number of
# blocks ends in a half pair
CASES = [
    ("Q4_1", 96),
    ("Q4_1", 576),
    ("Q4_K", 256),
    ("Q8_0", 96),
    ("Q8_0", 576),
    ("Q6_K", 768),
    ("Q5_1", 160),
]


def weight_and_x(gguf_type: str, k: int, rows: int, n: int = 37):
    w = from_gguf_blocks(random_gguf_blocks(gguf_type, n, k, seed=k + rows), gguf_type, (n, k))
    gen = torch.Generator().manual_seed(k * rows)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 1, k)
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    return w, x


@pytest.mark.parametrize(("gguf_type", "k"), CASES)
def test_matches_the_float64_reference_on_every_build(gguf_type, k):
    w, x = weight_and_x(gguf_type, k, rows=5)
    want = block_quant_matmul_q8a_torch(x, w)
    scale = (x.abs().double() @ block_quant_matmul_torch(torch.eye(k), w).abs().double()).max()
    for flags in ALL_FLAGS.values():
        got = block_quant_matmul(x, w, flags, int8_activations=True).double()
        # float32 sums of up to K terms of the reference's exact integer block sums
        assert (got - want).abs().max() <= 1e-6 * scale


@pytest.mark.parametrize(("gguf_type", "k"), CASES)
def test_every_build_agrees_bit_for_bit(gguf_type, k):
    # rows 6: a group of four and a group of two, on every path
    w, x = weight_and_x(gguf_type, k, rows=6)
    portable = block_quant_matmul(x, w, PORTABLE, int8_activations=True)
    for name in ("native", "avx2"):
        got = block_quant_matmul(x, w, ALL_FLAGS[name], int8_activations=True)
        assert torch.equal(got, portable), name


def test_extreme_codes_do_not_saturate():
    # AVX2 multiplies bytes in pairs into int16 (vpmaddubsw): weight codes of -128 against
    # activation codes of +-127 are the largest sums there are (2 * 128 * 127), on every path
    n, k = 5, 96
    nb = k // 32
    d = np.full((n, nb, 1), 0.01, dtype=np.float16).view(np.uint8)
    codes = np.full((n, nb, 32), -128, dtype=np.int8)
    codes[1::2, :, ::3] = 127  # mixed signs in some rows
    raw = np.concatenate([d, codes.view(np.uint8)], axis=-1).reshape(n, -1)
    w = from_gguf_blocks(raw, "Q8_0", (n, k))
    x = torch.full((3, k), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0  # every block's max is 1: codes +-127 exactly
    want = block_quant_matmul_q8a_torch(x, w)
    assert want.abs().max() > 100  # the sums really are large
    for name, flags in ALL_FLAGS.items():
        got = block_quant_matmul(x, w, flags, int8_activations=True).double()
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), name


@pytest.mark.parametrize(("gguf_type", "k"), CASES[:4])
def test_a_rows_result_does_not_depend_on_its_batch(gguf_type, k):
    w, x = weight_and_x(gguf_type, k, rows=7)
    batch = block_quant_matmul(x, w, int8_activations=True)
    for r in (0, 3, 6):
        alone = block_quant_matmul(x[r : r + 1], w, int8_activations=True)
        assert torch.equal(alone[0], batch[r])


def test_int8_activations_stay_close_to_float32():
    # the only new error is x rounded to 8 bits per block: well under 1% of the result's scale
    w, x = weight_and_x("Q4_1", 576, rows=4)
    exact = block_quant_matmul(x, w)
    q8 = block_quant_matmul(x, w, int8_activations=True)
    assert not torch.equal(exact, q8)
    assert ((q8 - exact).abs().max() / exact.abs().max()).item() < 0.01


def test_activation_quantization_rounds_half_to_even_and_keeps_the_extremes():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, -127.0, 2.5  # 2.5 -> 2 (half to even)
    x[0, 3] = 3.5  # -> 4
    codes, dx = quantize_activations_torch(x)
    assert codes[0, :4].tolist() == [127, -127, 2, 4]
    assert dx.item() == 1.0
    w, _ = weight_and_x("Q8_0", 32, rows=1, n=3)
    assert torch.equal(
        block_quant_matmul(x, w, int8_activations=True),
        block_quant_matmul(x, w, PORTABLE, int8_activations=True),
    )


def test_the_fast_paths_are_the_vnni_and_avx2_builds():
    with open("/proc/cpuinfo") as f:
        flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    vnni = "avx512_vnni" in flags and "avx512bw" in flags
    avx2 = "avx2" in flags and "fma" in flags
    assert q8_activations_fast() == (vnni or avx2)
    assert q8_activations_fast(AVX2) == avx2
    assert not q8_activations_fast(PORTABLE)
