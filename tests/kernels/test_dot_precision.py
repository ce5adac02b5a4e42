"""fp32 attention is exact fp32 on GPUs too: the kernels compiled for CUDA targets (no GPU needed,
Triton's own toolchain builds the PTX) use no TF32 tensor-core products for float32 caches, and
keep tensor cores for half types."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from prefixrag.kernels import extend_attention, paged_decode, scattered_attention
from prefixrag.kernels._precision import dot_precision

pytestmark = pytest.mark.skipif(
    "nvidia" not in triton.backends.backends, reason="this Triton has no NVIDIA backend"
)

# Each kernel with the constexprs of a typical CUDA launch (head_dim 64).
KERNELS = {
    "extend": (
        extend_attention._extend_attention_kernel,
        {"HEAD_DIM": 64, "BLOCK_M": 64, "BLOCK_N": 64},
    ),
    "paged_decode": (
        paged_decode._paged_decode_kernel,
        {"HEAD_DIM": 64, "BLOCK_G": 16, "BLOCK_N": 64, "IS_SPLIT": False},
    ),
    "scattered": (
        scattered_attention._scattered_attention_kernel,
        {"HEAD_DIM": 64, "BLOCK_M": 64, "BLOCK_N": 64},
    ),
}
_FLOAT_ARGS = {"q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"}
_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _ptx(kernel, constexprs: dict, dtype: torch.dtype, arch: int) -> str:
    # Under TRITON_INTERPRET the decorated kernel is an interpreted function: compile its Python
    # source through a JITFunction of our own instead.
    fn = getattr(kernel, "fn", kernel)
    names = list(inspect.signature(fn).parameters)
    constexprs = {**constexprs, "DOT_PRECISION": dot_precision(dtype)}
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _FLOAT_ARGS:
            signature[name] = "*" + _TRITON_TYPES[dtype]
        elif name == "lse_ptr":
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    source = ASTSource(
        JITFunction(fn),
        signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["ptx"]


def test_dot_precision_is_ieee_for_float32_only():
    assert dot_precision(torch.float32) == "ieee"
    assert dot_precision(torch.bfloat16) is None and dot_precision(torch.float16) is None


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", KERNELS)
def test_float32_kernels_use_no_tf32(name, arch):
    kernel, constexprs = KERNELS[name]
    ptx = _ptx(kernel, constexprs, torch.float32, arch)
    assert "tf32" not in ptx and "mma" not in ptx  # FMA products in full fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", KERNELS)
def test_half_kernels_keep_tensor_cores(name, dtype):
    kernel, constexprs = KERNELS[name]
    assert "mma" in _ptx(kernel, constexprs, dtype, 90)
