"""fp32 attention is exact fp32 on GPUs too: the kernels compiled for CUDA targets (no GPU needed,
Triton's own toolchain builds the PTX) use no TF32 tensor-core products for float32 caches, and
keep tensor cores for half types. The PTX comes from tests/kernels/ptx_probe.py, run once in a
fresh interpreter without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from prefixrag.kernels._precision import dot_precision

pytestmark = pytest.mark.skipif(
    "nvidia" not in triton.backends.backends, reason="this Triton has no NVIDIA backend"
)
ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("extend", "paged_decode", "scattered")


@pytest.fixture(scope="module")
def ptx_flags(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[bool]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # a cache of its own: every run compiles cold, as on a fresh machine
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.ptx_probe"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_dot_precision_is_ieee_for_float32_only():
    assert dot_precision(torch.float32) == "ieee"
    assert dot_precision(torch.bfloat16) is None and dot_precision(torch.float16) is None


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", KERNELS)
def test_float32_kernels_use_no_tf32(ptx_flags, name, arch):
    has_tf32, has_mma = ptx_flags[f"{name} fp32 {arch}"]
    assert not has_tf32 and not has_mma  # FMA products in full fp32


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", KERNELS)
def test_half_kernels_keep_tensor_cores(ptx_flags, name, dtype):
    _, has_mma = ptx_flags[f"{name} {dtype} 90"]
    assert has_mma
