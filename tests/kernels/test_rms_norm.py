"""Fused residual-add RMSNorm: reference vs torch.nn.functional.rms_norm, Triton vs reference."""

import pytest
import torch
import torch.nn.functional as F

from prefixrag.kernels.rms_norm import rms_norm, rms_norm_reference
from tests.kernels.paged_batch import assert_close, requires_gpu


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("hidden", [7, 64, 576])
def test_reference_matches_torch(has_residual, hidden):
    x, weight = torch.randn(5, hidden), torch.randn(hidden)
    residual = torch.randn(5, hidden) if has_residual else None
    out, s = rms_norm_reference(x, weight, 1e-5, residual)
    expected_s = x + residual if has_residual else x
    assert_close(s, expected_s, torch.float32)
    assert_close(out, F.rms_norm(expected_s, (hidden,), weight, eps=1e-5), torch.float32)


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize(("num_rows", "hidden"), [(1, 64), (5, 100), (3, 576), (0, 64)])
def test_triton_matches_reference(device, has_residual, num_rows, hidden):
    x = torch.randn(num_rows, hidden, device=device)
    weight = torch.randn(hidden, device=device)
    residual = torch.randn(num_rows, hidden, device=device) if has_residual else None
    x_before = x.clone()
    out, s = rms_norm(x, weight, 1e-6, residual)
    out_ref, s_ref = rms_norm_reference(x, weight, 1e-6, residual)
    assert_close(out, out_ref, torch.float32)
    assert_close(s, s_ref, torch.float32)
    assert torch.equal(x, x_before)


def test_bad_input_raises():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight has"):
        rms_norm(x, torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_reference(x, torch.ones(8), 1e-6, torch.randn(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="2 dims"):
        rms_norm(x[None], torch.ones(8), 1e-6)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large(dtype):
    x = torch.randn(4096, 4096, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device="cuda", dtype=dtype)
    out, s = rms_norm(x, weight, 1e-5, residual)
    out_ref, s_ref = rms_norm_reference(x, weight, 1e-5, residual)
    assert_close(out, out_ref, dtype)
    assert_close(s, s_ref, dtype)
