"""A Llama-family decoder (Llama, Mistral, Qwen2) in plain torch, built up from the smallest part.

RMSNorm -> rotary embedding -> attention -> SwiGLU MLP -> block -> model. Weights arrive under
Hugging Face names (``model.layers.0.self_attn.q_proj.weight``) and are fused on load (q/k/v into
one matrix, gate/up into another) so each block runs four matmuls. Attention reads and writes the
paged KV cache through an :class:`engine.attention.backend.AttentionBackend`. A kernel backend also
brings fused RMSNorm and RoPE kernels (its ``fused_ops``); the model picks those or its own torch
ops once, when it is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from prefixrag.engine.attention.backend import (
    AttentionBackend,
    FusedOps,
    RMSNormFn,
    RopeFn,
    SiluMulFn,
)
from prefixrag.engine.attention.metadata import AttentionMetadata
from prefixrag.engine.model_config import ModelConfig, RopeScaling
from prefixrag.engine.quant import embedding, linear


@dataclass(slots=True)
class ForwardContext:
    """What one forward pass needs besides the tokens: the KV cache and how to attend."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, bs, Hkv, D] each


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-mean-square norm in torch; with a residual it adds first. Returns (normed, sum)."""
    # x, residual: [T, H]
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


class RMSNorm(nn.Module):
    """Root-mean-square norm; with a residual it adds first and returns the sum as well.

    ``fn`` does the arithmetic: :func:`rms_norm_torch` or a fused kernel with its signature.
    """

    def __init__(self, size: int, eps: float, fn: RMSNormFn = rms_norm_torch) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.fn = fn

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim / 2], with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """``cat(cos, sin)`` per position, [max_positions, head_dim], float32 (the kernels' layout)."""
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    # explicit CPU: the model may be built under a meta-device context, this buffer may not
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face convention). x: [T, H, D]; cos, sin: [T, 1, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# Rotates (q [T, Hq, D], k [T, Hkv, D]) of one step; built once per step, shared by all layers.
Rope = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class TorchRope:
    """RoPE in torch: gathers the step's cos/sin rows once, then every layer rotates with them."""

    def __init__(self, cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> None:
        half = cos_sin_cache.shape[-1] // 2
        cos_sin = cos_sin_cache[positions].unsqueeze(1)  # [T, 1, D]
        self.cos, self.sin = cos_sin[..., :half], cos_sin[..., half:]

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)


class KernelRope:
    """RoPE through an in-place kernel, which reads cos_sin_cache[positions] itself."""

    def __init__(self, apply_rope_: RopeFn, cos_sin_cache: torch.Tensor, positions: torch.Tensor):
        self.apply_rope_ = apply_rope_
        self.cos_sin_cache = cos_sin_cache
        self.positions = positions

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.apply_rope_(q, k, self.positions, self.cos_sin_cache)
        return q, k


class Attention(nn.Module):
    """Grouped-query attention with optional q/k/v bias (Qwen2) and a paged KV cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_weight = _param(q_size + 2 * kv_size, config.hidden_size)
        self.qkv_bias = _param(q_size + 2 * kv_size) if config.attention_bias else None
        self.o_weight = _param(config.hidden_size, q_size)
        has_o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_bias = _param(config.hidden_size) if has_o_bias else None

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        # x: [T, hidden]
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        # q: [T, Hq, D], k: [T, Hkv, D]; views into qkv, which a kernel rope rotates in place
        q, k = rope(
            q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        )
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.metadata)  # [T, Hq, D]
        return linear(out.reshape(out.shape[0], -1), self.o_weight, self.o_bias)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate/up output [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, silu_mul: SiluMulFn = silu_mul_torch) -> None:
        super().__init__()
        self.gate_up_weight = _param(2 * config.intermediate_size, config.hidden_size)
        self.down_weight = _param(config.hidden_size, config.intermediate_size)
        self.silu_mul = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.silu_mul(linear(x, self.gate_up_weight)), self.down_weight)


class Block(nn.Module):
    """Pre-norm transformer block; the residual stream is carried beside the hidden state."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        norm_fn: RMSNormFn,
        silu_mul: SiluMulFn = silu_mul_torch,
    ) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_fn)
        self.attn = Attention(config, layer_idx)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_fn)
        self.mlp = MLP(config, silu_mul)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, rope, ctx)
        h, residual = self.post_attn_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Token ids and positions in, final hidden states out; :meth:`logits` applies the head.

    With ``fused_ops`` (from a kernel attention backend) every norm, RoPE (and SiLU-and-multiply,
    if it brings one) runs those kernels; without, the torch ops here.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int | None = None,
        fused_ops: FusedOps | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        norm_fn = rms_norm_torch if fused_ops is None else fused_ops.rms_norm
        silu_mul = (fused_ops and fused_ops.silu_mul) or silu_mul_torch
        # (cos_sin_cache, positions) -> the step's Rope
        self.make_rope: Callable[[torch.Tensor, torch.Tensor], Rope] = (
            TorchRope if fused_ops is None else partial(KernelRope, fused_ops.apply_rope_)
        )
        self.embed_weight = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config, i, norm_fn, silu_mul) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_fn)
        self.lm_head_weight = (
            None if config.tie_word_embeddings else _param(*self.embed_weight.shape)
        )
        positions = max_positions or config.max_position_embeddings
        self.register_buffer(
            "cos_sin_cache", build_cos_sin_cache(config, positions), persistent=False
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden], before the final norm
        rope = self.make_rope(self.cos_sin_cache, positions)
        x = embedding(input_ids, self.embed_weight)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        return x + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the chosen rows: [N, hidden] -> float32 [N, vocab]."""
        h, _ = self.norm(hidden)
        head = self.embed_weight if self.lm_head_weight is None else self.lm_head_weight
        return linear(h, head).float()

    def load_hf_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Adopt Hugging Face-named weights (fusing q/k/v and gate/up); every one must be used.

        Parameters are replaced, not copied into, so the model may be built on the meta device.
        """
        from prefixrag.engine.weights.mapping import assign_hf_weights

        assign_hf_weights(self, tensors)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)
