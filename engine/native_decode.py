"""Wires a loaded model into the one-call C decode step (kernels/decode_step.py), where it fits.

The C step takes GGUF block weights (``weight_quant=gguf``), or a float32 model's plain matrices,
in float32 on CPU, over a float32, float16 or bfloat16 KV cache. Plain matrices go through the
same fixed-order matmul (kernels/csrc/block_quant.h) as the torch model's decode-sized
``linear``, so a float32 model's decode loses only its Python per layer. The runner uses
it for steps made only of decode tokens, up to ``MAX_ROWS`` of them; every other step, and every
model it does not fit, runs the torch model as before.
"""

from __future__ import annotations

import logging

import torch

from prefixrag.engine.model import LlamaModel
from prefixrag.kernels.block_quant_matmul import BlockQuantWeight
from prefixrag.kernels.block_stack import BlockStack
from prefixrag.kernels.cpu_ops import KV_KINDS, SPLIT_LEN
from prefixrag.kernels.decode_step import MAX_ROWS, DecodeLayer, DecodeStack, build
from prefixrag.kernels.native_build import NativeBuildError

__all__ = ["MAX_ROWS", "native_decode_stack"]
log = logging.getLogger(__name__)


def _plain_float32(w: object) -> bool:
    """A float32 matrix the C step reads in place (a float32 model's weight)."""
    return (
        isinstance(w, torch.Tensor)
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.dim() == 2
        and w.is_contiguous()
    )


def native_decode_stack(
    model: LlamaModel,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    split_len: int = SPLIT_LEN,
    *,
    int8_activations: bool = False,
) -> DecodeStack | None:
    """The C decode stack over ``model``'s weights and ``kv_caches``, or None (and why, logged
    at debug level) when the model is neither all block weights nor all float32 matrices (blocks
    only with int8 activations), or C cannot be built.
    ``split_len``: positions per attention split (cpu_ops.SPLIT_LEN; tests vary it).
    ``int8_activations``: the matmuls round their inputs to int8 (kernels/csrc/q8_act.h)."""
    config = model.config
    if model.norm.weight.dtype != torch.float32 or kv_caches[0][0].dtype not in KV_KINDS:
        log.debug("no C decode step: it runs float32 models (16-bit KV caches allowed) only")
        return None
    layers = []
    for block, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        attn, mlp = block.attn, block.mlp
        weights = (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight)
        blocks = all(isinstance(w, BlockQuantWeight | BlockStack) for w in weights)
        if not (blocks or (not int8_activations and all(map(_plain_float32, weights)))):
            log.debug(
                "no C decode step: layer %d has weights that are neither all GGUF blocks nor "
                "all float32 matrices (int8 activations need blocks)",
                block.attn.layer_idx,
            )
            return None
        layers.append(
            DecodeLayer(
                block.input_norm.weight.detach(),
                block.post_attn_norm.weight.detach(),
                *weights,
                k_cache=k_cache,
                v_cache=v_cache,
                qkv_bias=None if attn.qkv_bias is None else attn.qkv_bias.detach(),
                o_bias=None if attn.o_bias is None else attn.o_bias.detach(),
            )
        )
    try:
        build()
    except NativeBuildError as err:
        log.warning("C decode step unavailable, decode runs the torch model (slower): %s", err)
        return None
    return DecodeStack(
        layers,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        eps=config.rms_norm_eps,
        scale=scale,
        cos_sin_cache=model.cos_sin_cache,
        split_len=split_len,
        int8_activations=int8_activations,
    )
