"""Shared test configuration, applied before any test module is imported.

- Every test stays offline: no model hub is reachable here.
- Without a GPU, Triton kernels run through Triton's interpreter. `triton.jit` decides at
  decoration time (when a kernels module is first imported) whether to build an interpreted
  function, so the variable must be set before any test imports kernels/, engine/ or app/.
"""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
