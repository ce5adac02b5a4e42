"""Kernel tests run the Triton kernels on CPU through Triton's interpreter when there is no GPU.

`triton.jit` decides at decoration time (when a kernels module is imported) whether it builds an
interpreted function, so TRITON_INTERPRET must be set before any kernels module is imported.
This conftest is imported before the test modules of this directory; if another test directory
already imported a kernels module in this process, those modules are reloaded so their kernels
are rebuilt under the interpreter. The variable stays set for the rest of the pytest process: it
only changes how Triton kernels run, and without CUDA they cannot run any other way.
"""

import importlib
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in [n for n in sys.modules if n.startswith("kernels.")]:
        importlib.reload(sys.modules[_name])

# The device the non-gpu tests run the Triton kernels on (the interpreter on CPU).
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def device() -> str:
    """Where the kernel under test runs: CUDA when present, else CPU through the interpreter."""
    return DEVICE
