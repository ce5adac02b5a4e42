"""A GGUF file's own Q4_K and Q6_K rows (kinds q4_k, q6_k) in every C path, against gguf-py's
dequantizer and against the planes the same bytes convert to; with int8 activations, against
the exact sum over x quantized per super-block."""

from __future__ import annotations

import pytest
import torch

from prefixrag.kernels.block_quant_matmul import (
    BlockQuantWeight,
    block_quant_dequantize,
    block_quant_matmul,
    block_quant_rows,
    fixed_order_matmul,
)
from prefixrag.kernels.block_quant_reference import (
    block_quant_matmul_q8k_torch,
    quantize_activations_q8k_torch,
)
from prefixrag.kernels.gguf_planes import from_gguf_blocks
from tests.kernels.test_block_quant_matmul import (
    ALL_FLAGS,
    BUILDS,
    gguf_reference,
    random_gguf_blocks,
)

KINDS = pytest.mark.parametrize(("gguf_type", "kind"), [("Q4_K", "q4_k"), ("Q6_K", "q6_k")])


def file_rows(gguf_type: str, kind: str, n: int, k: int, seed: int):
    raw = random_gguf_blocks(gguf_type, n, k, seed=seed)
    return raw, BlockQuantWeight(kind, torch.from_numpy(raw), None, None)


@BUILDS
@KINDS
@pytest.mark.parametrize(("n", "k"), [(1, 256), (5, 768), (33, 1536), (3, 8960)])
def test_file_rows_dequantize_as_gguf_does(flags, gguf_type, kind, n, k):
    raw, w = file_rows(gguf_type, kind, n, k, seed=n + k)
    assert tuple(w.shape) == (n, k)
    assert torch.equal(block_quant_dequantize(w, flags), gguf_reference(raw, gguf_type, n, k))


@BUILDS
@KINDS
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
def test_file_rows_give_the_planes_bits(flags, gguf_type, kind, rows):
    n, k = 37, 1536
    raw, w = file_rows(gguf_type, kind, n, k, seed=rows)
    planes = from_gguf_blocks(raw, gguf_type, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    got = block_quant_matmul(x, w, flags)
    assert torch.equal(got, block_quant_matmul(x, planes, flags))
    expected = gguf_reference(raw, gguf_type, n, k)
    assert torch.equal(got, fixed_order_matmul(x, expected, flags))


@BUILDS
@KINDS
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 40])
def test_int8_activations_on_file_rows(flags, gguf_type, kind, rows):
    """Against file rows, x is quantized per super-block (llama.cpp's Q8_K, q8k_act.h): the
    kernel's result is the exact float64 sum over those codes, up to float32 rounding."""
    n, k = 29, 2304
    _, w = file_rows(gguf_type, kind, n, k, seed=4)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.logspace(
        -1, 1, k
    )
    got = block_quant_matmul(x, w, flags, int8_activations=True)
    reference = block_quant_matmul_q8k_torch(x, w)
    scale = x.abs().double() @ block_quant_dequantize(w).abs().double().T
    assert ((got.double() - reference).abs() <= 2e-6 * scale + 1e-30).all()
    # and the rounding to 8 bits per 256 costs what it should: about 1% of the float32 product
    exact = block_quant_matmul(x, w, flags).double()
    assert (got.double() - exact).norm() < 0.02 * exact.norm()


def test_super_block_quantization_matches_its_reference():
    """A row's codes per super-block, through the C kernel's int8 path: x whose super-blocks
    each hold one element make every product one code times one weight."""
    n, k = 3, 512
    _, w = file_rows("Q6_K", "q6_k", n, k, seed=1)
    x = torch.zeros(2, k)
    x[0, 7], x[0, 300], x[1, 255] = 2.5, -0.75, 1.0  # one element per super-block: codes +-127
    dense = block_quant_dequantize(w).double()
    want = x.double() @ dense.T
    got = block_quant_matmul(x, w, int8_activations=True).double()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    codes, dx = quantize_activations_q8k_torch(x)
    assert codes[0, 7] == 127 and codes[0, 300] == -127 and dx[1, 0] == pytest.approx(1 / 127)


@KINDS
def test_every_build_gives_file_rows_the_same_bits(gguf_type, kind):
    _, w = file_rows(gguf_type, kind, 11, 1024, seed=8)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(9)) * torch.logspace(
        -3, 3, 1024
    )
    for q8 in (False, True):
        got = {n: block_quant_matmul(x, w, f, int8_activations=q8) for n, f in ALL_FLAGS.items()}
        for name, result in got.items():
            assert torch.equal(result, got["portable"]), (name, q8)


@KINDS
def test_embedding_rows_widen_only_what_is_asked(gguf_type, kind):
    raw, w = file_rows(gguf_type, kind, 50, 512, seed=2)
    ids = torch.tensor([[3, 49], [0, 3]])
    rows = block_quant_rows(w, ids)
    assert rows.shape == (2, 2, 512)
    assert torch.equal(rows, gguf_reference(raw, gguf_type, 50, 512)[ids])
    with pytest.raises(IndexError):
        block_quant_rows(w, torch.tensor([50]))


def test_file_rows_check_their_shape():
    with pytest.raises(ValueError, match="q4_k codes"):
        BlockQuantWeight("q4_k", torch.zeros(2, 100, dtype=torch.uint8), None, None)
    with pytest.raises(ValueError, match="no d or m"):
        BlockQuantWeight("q6_k", torch.zeros(2, 210, dtype=torch.uint8), torch.ones(2, 16), None)
    _, w = file_rows("Q4_K", "q4_k", 2, 256, seed=0)
    assert not BlockQuantWeight.can_fuse([w, w])
