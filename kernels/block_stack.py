"""Block weights stacked along N without copying: the q/k/v and gate/up matrices of a mapped
GGUF file, each a view of its own tensor and in its own type (a Q4_K_M file gives v Q6_K rows
beside Q4_K q and k in half its layers).

The model multiplies by one fused matrix where it can (one matmul for q/k/v): a stack is that
matrix, its parts' outputs laid side by side. The C decode step (kernels/decode_step.py) reads
the parts where they lie; prefill-sized matmuls widen the parts into one float32 matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixrag.kernels.block_quant_matmul import (
    BlockQuantWeight,
    block_quant_dequantize_into,
    block_quant_matmul,
)


@dataclass(slots=True)
class BlockStack:
    """Parts [N_i, K] stacked into one [sum N_i, K] matrix; every part has the same K."""

    parts: tuple[BlockQuantWeight, ...]
    # the float32 matrix, kept by the engine for prefill-sized matmuls when its budget allows
    dense: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a block stack needs at least one part")
        if len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError(
                f"stacked parts need one K, got {[tuple(p.shape) for p in self.parts]}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def int8_activations(self) -> bool:
        return self.parts[0].int8_activations

    def matmul(self, x: torch.Tensor, *, int8_activations: bool = False) -> torch.Tensor:
        """``x @ W.T`` through the block kernel, part by part: x [..., K] -> [..., N]."""
        outs = [block_quant_matmul(x, p, int8_activations=int8_activations) for p in self.parts]
        return torch.cat(outs, dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix [N, K], each part widened into its rows: float32, or that rounded to
        bfloat16 (``dtype=torch.bfloat16``)."""
        out = torch.empty(self.shape, dtype=dtype)
        at = 0
        for p in self.parts:
            block_quant_dequantize_into(p, out[at : at + p.shape[0]])
            at += p.shape[0]
        return out


def stack_or_fuse(parts: list[BlockQuantWeight]) -> BlockQuantWeight | BlockStack:
    """One weight for parts stacked along N: plane parts of one kind are fused into one matrix
    (a copy, as they are copies already), a file's rows are stacked where they lie."""
    if len(parts) == 1:
        return parts[0]
    if BlockQuantWeight.can_fuse(parts):
        return BlockQuantWeight.cat(parts)
    return BlockStack(tuple(parts))
