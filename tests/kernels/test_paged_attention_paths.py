"""The C paged attention on each path it is compiled for: AVX-512 (where the host has it), AVX2
built without AVX-512, and portable C built without either. Each one's dot products, value sums
and exponentials are its own code, so each is checked against naive float64 attention over
shapes that reach its vector loops, its tails and its fallbacks."""

from __future__ import annotations

import pytest
import torch

from prefixrag.kernels import cpu_ops
from tests.kernels.paged_batch import make_paged_batch, naive_attention
from tests.kernels.test_block_quant_matmul import ALL_FLAGS as PATHS

SHAPES = [
    (9, 3, 64),  # SmolLM2: every vector loop, d a multiple of 64
    (4, 2, 32),  # d a multiple of 32 but not 64: AVX-512 sums values in plain C
    (6, 3, 40),  # d no multiple of 16: plain C dots and sums on every path
    (8, 8, 256),  # 2,048 floats a slot: four positions a chunk
]


@pytest.fixture(params=list(PATHS), ids=list(PATHS))
def path(request, monkeypatch):
    flags = PATHS[request.param]
    lib = cpu_ops.build(flags)
    monkeypatch.setattr(cpu_ops, "build", lambda: lib)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_paged_decode_on_every_path_matches_naive(path, dtype, num_q_heads, num_kv_heads, head_dim):
    lens = [1, 45, 530]  # one position, a chunk and a tail, several splits of 256
    batch = make_paged_batch(lens, num_kv_heads, head_dim, 16, dtype=dtype)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=torch.Generator().manual_seed(3))
    # a large scale spreads the scores over a wide range: many exponentials far below the max
    # (the clamp at -87), some near it
    scale = 4.0 * head_dim**-0.5
    out = cpu_ops.paged_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, torch.tensor(lens).int(), scale
    )
    naive = torch.cat(
        [
            naive_attention(q[b : b + 1], batch.keys[b], batch.values[b], n - 1, scale)
            for b, n in enumerate(lens)
        ]
    )
    torch.testing.assert_close(out.double(), naive.double(), atol=2e-5, rtol=2e-5)
