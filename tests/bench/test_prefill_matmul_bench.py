"""prefill_matmul_bench: a smoke run on the packaged model, its kernels checked on each other."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from prefixrag.engine import quant
from prefixrag.kernels.block_quant_matmul import amx_ready, tile_min_rows
from tests.bench.helpers import RecordingLibrary


@pytest.mark.slow
@pytest.mark.skipif(not tile_min_rows(), reason="the block tiles need an AVX-512 build")
def test_a_smoke_run_times_every_kernel_and_both_warm_settings(tmp_path):
    out = tmp_path / "prefill.json"
    cmd = [
        sys.executable, "-m", "bench.prefill_matmul_bench", "--repeats", "1", "--rows", "16,40",
        "--out", str(out),
    ]  # fmt: skip
    # the run stops with an error if the tiles and the row loop disagree on a bit, or either
    # strays from the GEMM, or the warm prompts do not reuse the prefix
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    amx = amx_ready()
    assert list(result["matmuls"]["rows"]) == ["16", "40"]
    for cell in result["matmuls"]["rows"].values():
        assert {len(v) for v in cell["samples_ms"].values()} == {1}
        assert set(cell["samples_ms"]) == {"gemm", "tiles", "rows"} | ({"amx"} if amx else set())
    warm = result["warm_ttft"]
    assert set(warm["samples_ms"]) == {"gemm", "tiles"} | ({"amx"} if amx else set())
    assert {len(v) for v in warm["samples_ms"].values()} == {1}
    assert result["tile_kernel_max_rows"] == quant.TILE_KERNEL_MAX_ROWS
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.skipif(not amx_ready(), reason="--against times the AMX kernel")
def test_a_revisions_amx_kernel_runs_beside_todays_and_leaves_it_in_place():
    from bench import prefill_matmul_bench as bench
    from prefixrag.kernels import block_quant_matmul as bqm
    from prefixrag.kernels.block_quant_matmul import BlockQuantWeight, block_quant_matmul_amx

    load, source = bqm.load_library, bqm.load_library.__wrapped__
    gen = torch.Generator().manual_seed(0)
    w = BlockQuantWeight(
        "q4",
        torch.randint(0, 256, (40, 96), dtype=torch.uint8, generator=gen),
        torch.rand(40, 6, generator=gen),
        -torch.rand(40, 6, generator=gen),
    )
    x = torch.randn(24, 192, generator=gen)
    today = block_quant_matmul_amx(x, w)
    at_head = bench.amx_at("HEAD")(x, w, None)
    # HEAD's kernel is today's in a clean checkout: the same bits, through the revision's build
    assert torch.equal(at_head, today)
    assert bqm.load_library is load and bqm.load_library.__wrapped__ is source
    assert torch.equal(block_quant_matmul_amx(x, w), today)  # today's library still loaded


def test_amx_at_routes_the_kernel_call_to_the_revisions_library(monkeypatch):
    from bench import prefill_matmul_bench as bench
    from prefixrag.kernels import block_quant_matmul as bqm
    from prefixrag.kernels.block_quant_matmul import BlockQuantWeight

    lib, load = RecordingLibrary(), bqm.load_library
    monkeypatch.setattr(bench, "built_at", lambda rev, build: lib)
    w = BlockQuantWeight(
        "q4", torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2)
    )
    bench.amx_at("some-rev")(torch.randn(20, 64), w, None)
    assert lib.calls == ["block_quant_matmul_amx"]
    assert bqm.load_library is load
