"""The precision the attention kernels ask of ``tl.dot``."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str | None:
    """The ``input_precision`` for ``tl.dot`` on operands of ``dtype``, passed as a constexpr.

    ``"ieee"`` for float32: by default Triton rounds float32 operands to TF32 on NVIDIA tensor
    cores (a 10-bit mantissa, ~1e-3 relative error), so an fp32 cache would be attended no more
    exactly than TF32 allows and fp32 results could not be held to fp32 references. None keeps
    the backend's default for half types, where the option does not apply (they use tensor cores
    either way) and not every backend accepts every setting.
    """
    return "ieee" if dtype == torch.float32 else None
