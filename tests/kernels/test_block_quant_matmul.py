"""The block-quantized CPU matmul against its torch reference and against gguf's dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.kernels.block_quant_matmul import (
    BlockQuantWeight,
    block_quant_dequantize,
    block_quant_dequantize_into,
    block_quant_matmul,
    fixed_order_matmul,
    simd_lanes,
    tile_min_rows,
)
from prefixrag.kernels.block_quant_reference import (
    block_quant_matmul_torch,
    dequantize_torch,
)
from prefixrag.kernels.gguf_planes import from_gguf_blocks
from prefixrag.kernels.native_build import DEFAULT_FLAGS

# every C path this host can run must agree: native (AVX-512 where the host has it), the AVX2
# path built without AVX-512, and the portable one built without either
AVX2_FLAGS = (*DEFAULT_FLAGS, "-mno-avx512f")
PORTABLE_FLAGS = (*AVX2_FLAGS, "-mno-avx2")
ALL_FLAGS = {"native": DEFAULT_FLAGS, "avx2": AVX2_FLAGS, "portable": PORTABLE_FLAGS}
BUILDS = pytest.mark.parametrize("flags", list(ALL_FLAGS.values()), ids=list(ALL_FLAGS))


def host_cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        line = next((ln for ln in f if ln.startswith("flags")), "flags:")
    return set(line.split(":", 1)[1].split())


def random_gguf_blocks(gguf_type: str, n: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF blocks with random codes and sane fp16 scales, [n, k/32 * block bytes]."""
    rng = np.random.default_rng(seed)
    if gguf_type.endswith("_K"):
        return random_k_blocks(gguf_type, rng, n, k)
    nb = k // 32
    d = rng.uniform(0.001, 0.05, (n, nb, 1)).astype(np.float16).view(np.uint8)
    if gguf_type == "Q8_0":
        codes = rng.integers(-127, 128, (n, nb, 32), dtype=np.int8).view(np.uint8)
        return np.concatenate([d, codes], axis=-1).reshape(n, -1)
    # Q5_0 and Q5_1: 4 bytes of fifth bits, then the low nibbles
    codes = rng.integers(0, 256, (n, nb, 20 if gguf_type.startswith("Q5") else 16), dtype=np.uint8)
    if gguf_type == "Q5_0":
        return np.concatenate([d, codes], axis=-1).reshape(n, -1)
    if gguf_type == "Q4_0":
        return np.concatenate([d, codes], axis=-1).reshape(n, -1)
    m = rng.uniform(-0.2, 0.0, (n, nb, 1)).astype(np.float16).view(np.uint8)
    return np.concatenate([d, m, codes], axis=-1).reshape(n, -1)


def random_k_blocks(gguf_type: str, rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Q4_K, Q5_K or Q6_K super-blocks: fp16 scales of either sign (some zero, some subnormal)
    and random bytes for the packed sub-block scales and codes (every bit pattern is valid)."""
    s = k // 256
    d = (rng.uniform(-0.01, 0.01, (2, n, s, 1)) * (rng.random((2, n, s, 1)) < 0.9)).astype(
        np.float16
    )
    d[:, 0] = np.float16(3e-7)  # fp16 subnormal: exact in float32 too
    if gguf_type == "Q6_K":  # low nibbles, high bit pairs, int8 scales, then d
        packed = rng.integers(0, 256, (n, s, 128 + 64 + 16), dtype=np.uint8)
        return np.concatenate([packed, d[0].view(np.uint8)], axis=-1).reshape(n, -1)
    # Q4_K: d, dmin, scales, codes; Q5_K: fifth bits before the codes
    packed = rng.integers(0, 256, (n, s, 12 + 128 + 32 * (gguf_type == "Q5_K")), dtype=np.uint8)
    return np.concatenate([d[0].view(np.uint8), d[1].view(np.uint8), packed], axis=-1).reshape(
        n, -1
    )


def gguf_reference(raw: np.ndarray, gguf_type: str, n: int, k: int) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[gguf_type]
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(n, k))


@BUILDS
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 96), (33, 576), (64, 1536)])
def test_dequantize_is_gguf_bit_for_bit(flags, gguf_type, n, k):
    raw = random_gguf_blocks(gguf_type, n, k, seed=n + k)
    w = from_gguf_blocks(raw, gguf_type, (n, k))
    expected = gguf_reference(raw, gguf_type, n, k)
    assert torch.equal(dequantize_torch(w), expected)
    assert torch.equal(block_quant_dequantize(w, flags), expected)


@BUILDS
@pytest.mark.parametrize(
    ("gguf_type", "kind"), [("Q4_K", "q4"), ("Q5_K", "q8m"), ("Q6_K", "q8_16")]
)
@pytest.mark.parametrize(("n", "k"), [(1, 256), (5, 768), (33, 1536)])
def test_k_quants_repack_to_gguf_bit_for_bit(flags, gguf_type, kind, n, k):
    raw = random_gguf_blocks(gguf_type, n, k, seed=n)
    w = from_gguf_blocks(raw, gguf_type, (n, k))
    expected = gguf_reference(raw, gguf_type, n, k)
    assert w.kind == kind
    assert torch.equal(dequantize_torch(w), expected)
    assert torch.equal(block_quant_dequantize(w, flags), expected)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(n))
    assert torch.equal(block_quant_matmul(x, w, flags), fixed_order_matmul(x, expected, flags))


@BUILDS
@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 5, 32), (3, 40, 160), (8, 96, 576), (17, 9, 1536)]
)
def test_matmul_matches_reference(flags, gguf_type, rows, n, k):
    w = from_gguf_blocks(random_gguf_blocks(gguf_type, n, k, seed=rows), gguf_type, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    got = block_quant_matmul(x, w, flags)
    torch.testing.assert_close(got, block_quant_matmul_torch(x, w), atol=1e-4, rtol=1e-5)


@BUILDS
def test_a_row_does_not_depend_on_its_batch(flags):
    n, k = 70, 576
    w = from_gguf_blocks(random_gguf_blocks("Q4_1", n, k, seed=1), "Q4_1", (n, k))
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(2))
    full = block_quant_matmul(x, w, flags)
    for r in (0, 5, 12):
        assert torch.equal(block_quant_matmul(x[r : r + 1], w, flags)[0], full[r])
    assert torch.equal(block_quant_matmul(x[3:9], w, flags), full[3:9])


def test_each_build_takes_its_path():
    host = host_cpu_flags()
    assert simd_lanes(PORTABLE_FLAGS) == 1
    if {"avx2", "fma"} <= host:
        assert simd_lanes(AVX2_FLAGS) == 8
    if "avx512f" in host:
        assert simd_lanes(DEFAULT_FLAGS) == 16
        assert tile_min_rows(DEFAULT_FLAGS) > 0
    assert tile_min_rows(AVX2_FLAGS) == tile_min_rows(PORTABLE_FLAGS) == 0


@BUILDS
@pytest.mark.parametrize(
    ("gguf_type", "n", "k"),
    [("Q4_1", 70, 576), ("Q8_0", 53, 1504), ("Q5_1", 25, 160), ("Q6_K", 49, 768)],
)
def test_tens_of_rows_get_each_row_its_bits_alone(flags, gguf_type, n, k):
    # past tile_min_rows the AVX-512 build packs rows of x and weight rows into tiles
    # (csrc/block_tiles.h): whole tiles, the rows of x past them and the weight rows past the
    # last whole tile must all sum as a row alone does (decode), for every kind, for a whole
    # number of rounds and a half one (1504 and 160: odd block counts)
    w = from_gguf_blocks(random_gguf_blocks(gguf_type, n, k, seed=n), gguf_type, (n, k))
    gen = torch.Generator().manual_seed(k)
    # mixed magnitudes and signs, so a different order would show in the low bits
    x = torch.randn(67, k, generator=gen) * torch.logspace(-3, 3, k)
    alone = torch.cat([block_quant_matmul(x[r : r + 1], w, flags) for r in range(67)])
    for rows in (11, 12, 13, 16, 24, 37, 64, 67):
        assert torch.equal(block_quant_matmul(x[:rows], w, flags), alone[:rows]), rows
    assert torch.equal(block_quant_matmul(x, w, PORTABLE_FLAGS), alone)


@BUILDS
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
@pytest.mark.parametrize(("rows", "k"), [(1, 32), (2, 96), (3, 160), (5, 576), (4, 1504)])
def test_matmul_is_the_fixed_order_dot_over_the_dequantized_rows(flags, gguf_type, rows, k):
    # odd block counts end on a half round of the accumulators; rows past GROUP take a second
    # group; the SIMD matmul never expands a row, so this holds its unpacking to dot()'s order
    n = 37
    w = from_gguf_blocks(random_gguf_blocks(gguf_type, n, k, seed=k), gguf_type, (n, k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = fixed_order_matmul(x, block_quant_dequantize(w, flags), flags)
    assert torch.equal(block_quant_matmul(x, w, flags), expected)


@BUILDS
@pytest.mark.parametrize("k", [576, 1504])
def test_float32_rows_get_the_same_bits_in_any_batch(flags, k):
    # fixed_order_matmul runs 4 (AVX-512) or up to 8 (AVX2) rows a weight row's accumulators at a
    # time (the float32 decode of a batch), fewer rows the block kernel's way: every batch size
    # gives a row the bits it gets alone, for a whole number of rounds and a half one (1504 = 47
    # blocks)
    n = 41
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(13, k, generator=gen) * torch.logspace(-3, 3, k)
    alone = torch.cat([fixed_order_matmul(x[r : r + 1], w, flags) for r in range(13)])
    for rows in (2, 4, 5, 7, 8, 9, 13):
        assert torch.equal(fixed_order_matmul(x[:rows], w, flags), alone[:rows])


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0"])
def test_every_build_sums_in_the_same_order(gguf_type):
    n, k = 29, 1504  # 47 blocks: full rounds and a half one
    w = from_gguf_blocks(random_gguf_blocks(gguf_type, n, k, seed=6), gguf_type, (n, k))
    # mixed magnitudes and signs, so a different order would show in the low bits
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7)) * torch.logspace(-3, 3, k)
    results = {name: block_quant_matmul(x, w, flags) for name, flags in ALL_FLAGS.items()}
    for name, got in results.items():
        assert torch.equal(got, results["portable"]), name
    dense = dequantize_torch(w)
    assert torch.equal(fixed_order_matmul(x, dense, PORTABLE_FLAGS), results["portable"])
    # and the order is a real choice: plain torch sums differently (else this test proves little)
    assert not torch.equal(x @ dense.T, results["portable"])


def test_leading_dims_and_empty_batch():
    w = from_gguf_blocks(random_gguf_blocks("Q8_0", 6, 64, seed=3), "Q8_0", (6, 64))
    x = torch.randn(2, 3, 64)
    assert block_quant_matmul(x, w).shape == (2, 3, 6)
    torch.testing.assert_close(block_quant_matmul(x, w), block_quant_matmul_torch(x, w))
    assert block_quant_matmul(torch.empty(0, 64), w).shape == (0, 6)


def test_bad_inputs_raise_value_error():
    w = from_gguf_blocks(random_gguf_blocks("Q4_1", 4, 64, seed=4), "Q4_1", (4, 64))
    with pytest.raises(ValueError, match="features"):
        block_quant_matmul(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="float32"):
        block_quant_matmul(torch.randn(1, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="multiple of the block size"):
        from_gguf_blocks(np.zeros(40, np.uint8), "Q4_1", (1, 40))
    with pytest.raises(ValueError, match="Q4_K super-block"):
        from_gguf_blocks(np.zeros(144, np.uint8), "Q4_K", (1, 128))
    with pytest.raises(ValueError, match="Q3_K is not one of"):
        from_gguf_blocks(np.zeros(20, np.uint8), "Q3_K", (1, 32))
    with pytest.raises(ValueError, match="need m"):
        BlockQuantWeight("q4", w.codes, w.d, None)
    with pytest.raises(ValueError, match="codes must be"):
        BlockQuantWeight("q8", w.codes, w.d, None)


def test_fuse_and_permute_rows_keep_the_matrix():
    parts = [
        from_gguf_blocks(random_gguf_blocks("Q4_1", n, 64, seed=n), "Q4_1", (n, 64)) for n in (3, 5)
    ]
    fused = BlockQuantWeight.cat(parts)
    expected = torch.cat([dequantize_torch(p) for p in parts])
    assert torch.equal(dequantize_torch(fused), expected)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dequantize_torch(fused.select_rows(perm)), expected[perm])


def test_q8_fuses_with_q8m_bit_for_bit():
    # a Q5_1 q/k beside a Q8_0 v (Q5_K_M files): q8 joins as q8m with m = -0.0, which keeps
    # every weight's bits, the sign of its zeros included
    q = from_gguf_blocks(random_gguf_blocks("Q5_1", 4, 64, seed=8), "Q5_1", (4, 64))
    raw_v = random_gguf_blocks("Q8_0", 3, 64, seed=9).reshape(3, 2, 34)
    raw_v[0, 0, 2:] = 0  # zero codes ...
    raw_v[0, 0, :2] = np.array([-0.5], np.float16).view(np.uint8)  # ... times a negative d: -0.0
    v = from_gguf_blocks(raw_v, "Q8_0", (3, 64))
    assert BlockQuantWeight.can_fuse([q, v])
    fused = BlockQuantWeight.cat([q, v])
    assert fused.kind == "q8m"
    expected = torch.cat([dequantize_torch(q), dequantize_torch(v)])
    assert torch.signbit(expected[4, 0])
    for got in (dequantize_torch(fused), block_quant_dequantize(fused)):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    four_bit = from_gguf_blocks(random_gguf_blocks("Q4_1", 3, 64, seed=10), "Q4_1", (3, 64))
    assert not BlockQuantWeight.can_fuse([q, four_bit])
    with pytest.raises(ValueError, match="cannot fuse"):
        BlockQuantWeight.cat([q, four_bit])


def test_packaged_model_tensors_dequantize_exactly():
    # every block format the packaged SmolLM2 uses: Q4_1 layers and the Q8_0 embedding / LM head
    reader = gguf.GGUFReader(packaged_llm_path())
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        n, k = int(t.shape[1]), int(t.shape[0])
        w = from_gguf_blocks(t.data, t.tensor_type.name, (n, k))
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        assert torch.equal(block_quant_dequantize(w), expected.float())
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(block_quant_matmul(x, w), x @ expected.float().T)


@BUILDS
@pytest.mark.parametrize("gguf_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_the_bfloat16_matrix_is_the_float32_one_rounded(flags, gguf_type):
    n, k = 9, 768
    raw = random_gguf_blocks(gguf_type, n, k, seed=3)
    weights = [from_gguf_blocks(raw, gguf_type, (n, k))]
    if gguf_type.endswith("_K"):  # the file's own rows, as a mapped model reads them
        weights.append(BlockQuantWeight(gguf_type.lower(), torch.from_numpy(raw), None, None))
    for w in weights:
        expected = block_quant_dequantize(w, flags).to(torch.bfloat16)
        out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
        block_quant_dequantize_into(w, out, flags)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), w.kind
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        block_quant_dequantize_into(weights[0], torch.empty(n, k, dtype=torch.float16), flags)
