"""The prefill GEMM over a weight packed once: its values against a float64 reference, a row's
bits whatever the row count, the fallback without oneDNN, and the GGUF engine's prefill through
it against the same blocks without packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine import packed_gemm, quant
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_runner import ModelRunner
from prefixrag.engine.packed_gemm import PackedWeight, pack_weight, packed_linear
from prefixrag.kernels.block_quant_matmul import BlockQuantWeight
from tests.engine.llm_fixtures import model_cache_dir

needs_packing = pytest.mark.skipif(
    not packed_gemm.packing_available(), reason="torch built without oneDNN"
)


def _matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@needs_packing
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (70, 96)])
@pytest.mark.parametrize("rows", [1, 17, 33, 300])
def test_packed_linear_matches_a_float64_reference(n, k, rows):
    weight, x = _matrix(n, k, 0), _matrix(rows, k, 1)
    packed = pack_weight(weight)
    assert isinstance(packed, PackedWeight) and packed.shape == (n, k)
    out = packed_linear(x, packed)
    want = (x.double() @ weight.double().T).float()
    # float32 sums of k products: within what MKL's own GEMM is off by
    slack = (F.linear(x, weight) - want).abs().max().item()
    assert out.shape == (rows, n)
    assert (out - want).abs().max().item() <= max(4 * slack, 1e-4 * k**0.5)


@needs_packing
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    # the prefix cache relies on it: a token prefilled in a big chunk or a small one, or alone
    weight = _matrix(960, 576, 2)
    packed = pack_weight(weight)
    x = _matrix(2080, 576, 3)
    first = packed_linear(x[:17], packed)
    for rows in (18, 32, 33, 100, 512, 2080):
        assert torch.equal(packed_linear(x[:rows], packed)[:17], first), rows
    assert torch.equal(packed_linear(x[5:6], packed)[0], first[5])


@needs_packing
def test_leading_dimensions_are_kept_and_bad_widths_rejected():
    weight = _matrix(40, 64, 4)
    packed = pack_weight(weight)
    x = _matrix(6, 64, 5).reshape(2, 3, 64)
    out = packed_linear(x, packed)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out.reshape(6, 40), packed_linear(x.reshape(6, 64), packed))
    with pytest.raises(ValueError, match="expected 64 input features, got 32"):
        packed_linear(torch.ones(3, 32), packed)


def test_pack_weight_rejects_what_it_cannot_pack():
    with pytest.raises(ValueError, match="float32 CPU matrix"):
        pack_weight(torch.ones(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 CPU matrix"):
        pack_weight(torch.ones(2, 4, 4))


def test_without_onednn_the_plain_matrix_runs_f_linear(monkeypatch):
    monkeypatch.setattr(packed_gemm, "packing_available", lambda: False)
    weight, x = _matrix(30, 64, 6), _matrix(20, 64, 7)
    kept = pack_weight(weight)
    assert kept is weight
    assert torch.equal(packed_linear(x, kept), F.linear(x, weight))


@needs_packing
def test_gguf_prefill_through_packed_weights_matches_the_unpacked_blocks(request, monkeypatch):
    monkeypatch.setattr(quant, "bf16_prefill", lambda: False)  # float32 on both sides
    runner = ModelRunner(
        EngineConfig(
            model=str(packaged_llm_path()),
            num_kv_blocks=8,
            weight_quant="gguf",
            cache_dir=str(model_cache_dir(request)),
            kv_cache_dtype="float32",
        )
    )
    blocks = [  # the matmul weights (the embedding table is read row by row, never packed)
        v
        for m in runner.model.modules()
        for k, v in vars(m).items()
        if isinstance(v, BlockQuantWeight) and k != "embed_weight"
    ]
    assert blocks and all(isinstance(w.dense, PackedWeight) for w in blocks)
    # more rows than the block kernel takes (its tiles included): the prefill GEMM's
    x = _matrix(quant.TILE_KERNEL_MAX_ROWS + 16, blocks[0].shape[1], 8)
    packed_out = quant.linear(x, blocks[0])
    saved = blocks[0].dense
    blocks[0].dense = None  # dequantized on the fly and run by MKL, as before packing
    try:
        plain_out = quant.linear(x, blocks[0])
    finally:
        blocks[0].dense = saved
    torch.testing.assert_close(packed_out, plain_out, atol=1e-4, rtol=1e-4)
