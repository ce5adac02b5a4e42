"""The C tile kernel for extends after a cached prefix (csrc/extend_tiles.h) against naive float64
causal attention, on each path it is compiled for (AMX for 16-bit caches and AVX-512 where the
host has them, AVX2, portable C), and the claim it makes: a row's result depends on that row
alone, not on the tile, the other extends of the call or the thread count."""

from __future__ import annotations

import pytest
import torch

from prefixrag.kernels import cpu_ops
from prefixrag.kernels.native_build import DEFAULT_FLAGS
from tests.kernels.paged_batch import make_paged_batch, naive_attention
from tests.kernels.test_block_quant_matmul import ALL_FLAGS, host_cpu_flags
from tests.kernels.test_paged_attention_paths import SHAPES

# on an AMX host the native build takes AMX for float16 and bfloat16 caches (csrc/extend_amx.h):
# "no-amx" is the same build with the AVX-512 fused multiply-adds instead
PATHS = {**ALL_FLAGS, "no-amx": (*DEFAULT_FLAGS, "-DEXT_NO_AMX")}


@pytest.fixture(params=list(PATHS), ids=list(PATHS))
def path(request, monkeypatch):
    lib = cpu_ops.build(PATHS[request.param])
    monkeypatch.setattr(cpu_ops, "build", lambda: lib)
    return request.param


def run_extends(batch, q, prefixes, news, scale, first_row=0, out=None):
    """The kernel over extends laid end to end in q from ``first_row``."""
    starts = [first_row + sum(news[:i]) for i in range(len(news))]
    return cpu_ops.paged_extend_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[: len(news)],
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(prefixes, dtype=torch.int32),
        torch.tensor(news, dtype=torch.int32),
        scale,
        out,
    )


def expected_rows(batch, q, prefixes, news, scale, first_row=0):
    start, rows = first_row, []
    for b, (p, n) in enumerate(zip(prefixes, news, strict=True)):
        rows.append(naive_attention(q[start : start + n], batch.keys[b], batch.values[b], p, scale))
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_extends_on_every_path_match_naive(path, dtype, num_q_heads, num_kv_heads, head_dim):
    # one row over a long prefix; a tile and a half (32 rows a tile) crossing a split (512
    # positions); a short extend whose last chunk is partly its own rows; a prefix of one
    prefixes, news = [700, 530, 33, 1], [1, 45, 7, 3]
    lens = [p + n for p, n in zip(prefixes, news, strict=True)]
    batch = make_paged_batch(lens, num_kv_heads, head_dim, 16, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(news) + 2, num_q_heads, head_dim, generator=gen)
    scale = 4.0 * head_dim**-0.5  # wide scores: many exponentials far below the max
    out = torch.full_like(q, 7.0)
    run_extends(batch, q, prefixes, news, scale, first_row=1, out=out)
    # the rows before and after the extends are left alone
    assert torch.equal(out[0], torch.full_like(out[0], 7.0))
    assert torch.equal(out[-1], torch.full_like(out[-1], 7.0))
    torch.testing.assert_close(
        out[1:-1].double(),
        expected_rows(batch, q, prefixes, news, scale, first_row=1),
        atol=2e-5,
        rtol=2e-5,
    )


@pytest.mark.parametrize("block_size", [16, 5])
def test_odd_block_sizes_and_a_long_extend_match_naive(block_size):
    prefixes, news = [90, 3], [70, 130]  # several tiles each, blocks that cut chunks
    lens = [p + n for p, n in zip(prefixes, news, strict=True)]
    batch = make_paged_batch(lens, 3, 64, block_size, dtype=torch.float16)
    q = torch.randn(sum(news), 9, 64, generator=torch.Generator().manual_seed(6))
    out = run_extends(batch, q, prefixes, news, 0.125)
    torch.testing.assert_close(
        out.double(), expected_rows(batch, q, prefixes, news, 0.125), atol=2e-5, rtol=2e-5
    )


def test_a_row_gets_the_same_bits_whatever_shares_its_call(path):
    # the last 40 rows of an extend of 75 after 600 cached, computed (a) as part of that
    # extend beside another extend, (b) as their own extend of 40 after 635, (c) one row at a
    # time; and with one thread or two
    batch = make_paged_batch([675, 50], 3, 64, 16, dtype=torch.float16)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(75 + 50, 9, 64, generator=gen)
    whole = run_extends(batch, q, [600, 10], [75, 40], 0.125)[35:75]
    tail = run_extends(batch, q[35:75], [635], [40], 0.125)
    assert torch.equal(whole, tail)
    for r in (0, 17, 39):
        one = run_extends(batch, q[35 + r : 36 + r], [635 + r], [1], 0.125)
        assert torch.equal(one[0], whole[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_extends(batch, q[35:75], [635], [40], 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, tail)


def test_rejects_rows_outside_q_an_empty_extend_and_a_bad_table_touching_nothing():
    batch = make_paged_batch([40], 2, 32, 8, extra_blocks=0)
    q = torch.randn(8, 4, 32)
    out = torch.full_like(q, 3.0)

    def call(prefix, n, start=0, tables=batch.block_tables):
        cpu_ops.paged_extend_attention(
            q,
            batch.k_cache,
            batch.v_cache,
            tables,
            torch.tensor([start]),
            torch.tensor([prefix], dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32),
            0.2,
            out,
        )

    with pytest.raises(ValueError, match="inside q"):
        call(32, 8, start=1)  # rows 1..8 of 8
    with pytest.raises(ValueError, match="inside q"):
        call(32, 0)
    with pytest.raises(ValueError, match="block table"):
        call(40, 8)  # 48 positions; the table holds 40
    bad = batch.block_tables.clone()
    bad[0, 2] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="blocks in"):
        call(32, 8, tables=bad)
    assert torch.equal(out, torch.full_like(out, 3.0))
    with pytest.raises(ValueError, match="q_starts"):
        cpu_ops.paged_extend_attention(
            q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([32], dtype=torch.int32),
            torch.tensor([8], dtype=torch.int32),
            0.2,
        )


def test_scores_that_climb_far_past_the_running_max_match_naive(path):
    # the kernel moves a query's running max only when a chunk passes it by more than 8: keys
    # that grow with their position make every row's max climb by about 40 over the prefix,
    # past the slack many times, with terms above the old max in between; a late dip below
    # the first chunks' scores and a last key far above all others come too
    prefix, n, bs = 700, 20, 16
    batch = make_paged_batch([prefix + n], 3, 64, bs)
    gen = torch.Generator().manual_seed(8)
    u = torch.randn(64, generator=gen)  # the direction every query leans along
    q = torch.randn(n, 9, 64, generator=gen) + 0.8 * u
    ramp = torch.linspace(0.0, 6.0, prefix + n)  # scores along u: 0 .. about 40
    ramp[400:450] = -3.0
    ramp[prefix + n - 1] = 12.0
    keys = batch.keys[0] + ramp[:, None, None] * u
    table = batch.block_tables[0]
    for p in range(prefix + n):
        batch.k_cache[table[p // bs], p % bs] = keys[p]
    batch.keys[0] = keys
    scores = torch.einsum("hd,pd->hp", q[0, :3], keys[:, 0]) * 0.125
    assert scores[:, -2].min() - scores[:, :32].max() > 24  # the max climbs past the slack
    out = run_extends(batch, q, [prefix], [n], 0.125)
    expected = expected_rows(batch, q, [prefix], [n], 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_amx_is_taken_where_the_host_has_it():
    # else the tests above would check the fused multiply-adds twice and AMX never
    has_amx = {"amx_bf16", "amx_tile", "avx512_bf16"} <= host_cpu_flags()
    assert cpu_ops.extend_amx_ready(64) == has_amx
    assert not cpu_ops.build(PATHS["no-amx"]).extend_amx_ready(64)
    if has_amx:
        assert not cpu_ops.extend_amx_ready(48)  # head_dim must be a multiple of 32


@pytest.mark.skipif(not cpu_ops.extend_amx_ready(64), reason="the host has no AMX-BF16")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_amx_and_fused_multiply_adds_agree_to_float32(dtype, monkeypatch):
    # one extend over a long prefix, crossing splits and tiles, and a short one; wide scores
    # (|s| up to ~30). The builds sum in different orders: they agree to float32's rounding.
    prefixes, news = [1100, 40], [70, 9]
    lens = [p + n for p, n in zip(prefixes, news, strict=True)]
    batch = make_paged_batch(lens, 3, 64, 16, dtype=dtype)
    q = torch.randn(sum(news), 9, 64, generator=torch.Generator().manual_seed(9))
    scale = 4.0 * 64**-0.5
    outs, libs = {}, {name: cpu_ops.build(PATHS[name]) for name in ("native", "no-amx")}
    for name, lib in libs.items():
        monkeypatch.setattr(cpu_ops, "build", lambda lib=lib: lib)
        outs[name] = run_extends(batch, q, prefixes, news, scale)
    assert not torch.equal(outs["native"], outs["no-amx"])  # two kernels ran, not one twice
    torch.testing.assert_close(outs["native"], outs["no-amx"], atol=2e-5, rtol=2e-5)
    expected = expected_rows(batch, q, prefixes, news, scale)
    torch.testing.assert_close(outs["native"].double(), expected, atol=2e-5, rtol=2e-5)
