"""PTX of the attention kernels compiled for CUDA targets, without a GPU (Triton's own toolchain
builds it). Run by tests/kernels/test_dot_precision.py in a fresh interpreter without
TRITON_INTERPRET: under the interpreter, Triton patches triton.language for interpreted kernels,
and a cold compile in that process fails (a warm Triton cache hid it).

    python -m tests.kernels.ptx_probe   # one JSON line: {"kernel dtype arch": [tf32?, mma?], ...}
"""

from __future__ import annotations

import inspect
import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from prefixrag.kernels import extend_attention, paged_decode, scattered_attention
from prefixrag.kernels._precision import dot_precision

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
    # the decorated kernel's own Python function, compiled through a JITFunction of our own
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


# (dtype, arch) pairs the tests ask about: float32 on Ampere and Hopper, half types on Hopper
CASES = [(torch.float32, 80), (torch.float32, 90), (torch.bfloat16, 90), (torch.float16, 90)]


def probe() -> dict[str, tuple[bool, bool]]:
    """Whether each kernel's PTX holds TF32 and MMA instructions, by "kernel dtype arch"."""
    result = {}
    for name, (kernel, constexprs) in KERNELS.items():
        for dtype, arch in CASES:
            ptx = _ptx(kernel, constexprs, dtype, arch)
            result[f"{name} {_TRITON_TYPES[dtype]} {arch}"] = ("tf32" in ptx, "mma" in ptx)
    return result


if __name__ == "__main__":
    print(json.dumps(probe()))
