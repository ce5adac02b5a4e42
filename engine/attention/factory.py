"""Picks an attention backend by name, for the device and dtype at hand."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from prefixrag.engine.attention.backend import AttentionBackend
from prefixrag.engine.attention.cpu_backend import NativeAttention
from prefixrag.engine.attention.torch_backend import TorchAttention
from prefixrag.engine.attention.triton_backend import KernelAttention

BACKENDS = ("auto", "torch", "native", "triton", "reference")
log = logging.getLogger(__name__)


def make_backend(
    name: str, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """``auto`` picks Triton on CUDA and, on CPU, ``native`` for float32 (the torch path with its
    decode attention and small ops in C, see :class:`NativeAttention`) when a C compiler is
    there, else ``torch``; ``reference`` runs the kernels' plain-torch references (slow, for
    checking).

    ``triton`` on a CPU runs the kernels through Triton's interpreter, which needs
    ``TRITON_INTERPRET=1`` set before kernels/ is first imported; otherwise ValueError.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    is_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        name = "triton" if is_cuda else _cpu_default(dtype)
    if name == "torch":
        return TorchAttention()
    if name == "native":
        if is_cuda or dtype != torch.float32:
            raise ValueError(f"the native attention backend runs float32 on CPU, not {dtype}")
        return NativeAttention()
    if name == "triton" and not is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton attention backend needs a CUDA device, or TRITON_INTERPRET=1 "
            "(set before kernels/ is imported) to run its kernels on CPU"
        )
    backend = KernelAttention(use_triton=name == "triton")
    if name == "triton" and not is_cuda:
        _check_interpreted(backend.kernel_modules)
    return backend


def _cpu_default(dtype: torch.dtype) -> str:
    from prefixrag.kernels import cpu_ops
    from prefixrag.kernels.native_build import NativeBuildError

    if dtype != torch.float32:
        return "torch"
    try:
        cpu_ops.build()
    except NativeBuildError as err:
        log.warning("C kernels unavailable, attention falls back to torch ops (slower): %s", err)
        return "torch"
    return "native"


def _check_interpreted(modules: Sequence[ModuleType]) -> None:
    import triton

    # triton.jit picks device code or the interpreter when a module is imported, not per call.
    compiled = [
        m.__name__
        for m in modules
        if any(isinstance(v, triton.JITFunction) for v in vars(m).values())
    ]
    if compiled:
        raise ValueError(
            f"{compiled} were imported before TRITON_INTERPRET=1 was set, so their kernels "
            "need a GPU; set the variable before importing kernels/ (or reload them)"
        )
