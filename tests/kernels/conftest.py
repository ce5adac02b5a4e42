"""Kernel tests run the Triton kernels on CPU through Triton's interpreter when there is no GPU.

tests/conftest.py sets TRITON_INTERPRET=1 before any test module imports kernels/: `triton.jit`
decides at decoration time whether it builds an interpreted function, so setting it here, after
other test directories may have imported kernels/, would be too late.
"""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# The device the non-gpu tests run the Triton kernels on (the interpreter on CPU).
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def device() -> str:
    """Where the kernel under test runs: CUDA when present, else CPU through the interpreter."""
    return DEVICE
