"""What an attention backend is: the protocol the model calls, and the fused ops it may bring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixrag.engine.attention.metadata import AttentionMetadata

# (x [T, H], weight [H], eps, residual [T, H] | None) -> (normed, x + residual), x's dtype
RMSNormFn = Callable[
    [torch.Tensor, torch.Tensor, float, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]
]
# (q [T, Hq, D], k [T, Hkv, D], positions [T], cos_sin_cache [P, D]) -> None; rotates in place
RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# gate_up [T, 2I] -> silu(gate) * up [T, I]
SiluMulFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The non-attention ops a kernel backend brings for the model: RMSNorm fused with the
    residual add, RoPE applied to q and k in place, and (if given) SiLU-and-multiply."""

    rms_norm: RMSNormFn
    apply_rope_: RopeFn
    silu_mul: SiluMulFn | None = None


class AttentionBackend(Protocol):
    """Writes this step's K/V into the cache, then attends.

    q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]; rows are ordered decodes first, as in
    :class:`AttentionMetadata`. ``fused_ops`` is None when the model should run its own torch
    norm and RoPE, else the kernels it should run instead.
    """

    fused_ops: FusedOps | None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...
