"""Prefill-sized float32 matmuls over a weight packed once, at load, in oneDNN's own layout.

``F.linear`` hands each call to MKL's sgemm, which copies the whole weight matrix into its
blocked panel layout before multiplying, on every call. At prefill sizes that copy is most of the
cost for a short extend: 32 new rows over a cached prefix re-pack every matrix of the model to
use each element 32 times (on a 2-core AVX2 host the copy took 42% of MKL's time). Packing once,
at load, removes it: measured on that host over SmolLM2-135M's four matrices per layer, 30
layers, 2 threads, 187 -> 118 ms at 32 rows, 431 -> 323 ms at 100 and 6.7 -> 6.0 s at 2,080.

The kernel is oneDNN's, through the op torch's own CPU inference compiler uses for frozen linear
layers (``mkldnn::_linear_pointwise`` over ``mkldnn::_reorder_linear_weight``). A row's result
does not depend on how many rows share the call (tests/engine/test_packed_gemm.py checks it), so
a token gets the same values whether prefilled in a big chunk or a small one. Where torch was
built without oneDNN, the weight stays a plain matrix and ``F.linear`` runs as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedWeight:
    """A float32 [N, K] matrix in oneDNN's blocked layout (opaque: only :func:`packed_linear`
    reads it)."""

    packed: torch.Tensor
    shape: torch.Size


@functools.cache
def packing_available() -> bool:
    """Whether this torch can pack a weight for oneDNN (CPU builds with MKLDNN)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 8)
        out = _run(torch.ones(2, 8), torch.ops.mkldnn._reorder_linear_weight(w))
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((2, 8), 8.0)))


def pack_weight(weight: torch.Tensor) -> PackedWeight | torch.Tensor:
    """``weight`` (float32 [N, K] on CPU) packed once; the matrix itself where packing is not
    available, so callers hand either to :func:`packed_linear`."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(
            f"expected a float32 CPU matrix, got {weight.dim()}-D {weight.dtype} on {weight.device}"
        )
    if not packing_available():
        return weight
    # no batch-size hint: the one layout serves every row count (a hint of 32 was faster at
    # 17 rows and slower at 33)
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()), weight.shape)


def packed_linear(x: torch.Tensor, weight: PackedWeight | torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for float32 x [..., K]: through the packed layout, or ``F.linear`` for a plain
    matrix."""
    if not isinstance(weight, PackedWeight):
        return F.linear(x, weight)
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"expected {k} input features, got {x.shape[-1]}")
    lead = x.shape[:-1]
    out = _run(x.reshape(-1, k).contiguous(), weight.packed)
    return out.reshape(*lead, weight.shape[0])


def _run(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")
