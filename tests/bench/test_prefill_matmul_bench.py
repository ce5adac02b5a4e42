"""prefill_matmul_bench: a smoke run on the packaged model, its kernels checked on each other."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixrag.engine import quant
from prefixrag.kernels.block_quant_matmul import amx_ready, tile_min_rows


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
