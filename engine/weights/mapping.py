"""Copy Hugging Face-named tensors into :class:`engine.model.LlamaModel`'s fused parameters.

The model is typed as a plain nn.Module: model.py imports this module, so naming its class here
would make an import loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from prefixrag.engine.weights.gguf_loader import unpermute_rotary_rows
from prefixrag.kernels.block_quant_matmul import BlockQuantWeight, block_quant_dequantize
from prefixrag.kernels.block_stack import BlockStack, stack_or_fuse

if TYPE_CHECKING:
    from prefixrag.engine.weights.gguf_blocks import MappedGGUF


def assign_hf_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Fill every parameter of ``model`` from ``tensors``; raise ValueError on a missing, unused
    or misshapen tensor, so a wrong checkpoint never runs with garbage weights."""
    remaining = dict(tensors)

    def take(name: str) -> torch.Tensor:
        if name not in remaining:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        return remaining.pop(name)

    _set(model, "embed_weight", take("model.embed_tokens.weight"), "model.embed_tokens.weight")
    _set(model.norm, "weight", take("model.norm.weight"), "model.norm.weight")
    if model.lm_head_weight is not None:
        _set(model, "lm_head_weight", take("lm_head.weight"), "lm_head.weight")
    else:
        # Tied checkpoints sometimes still carry a copy of the embedding as lm_head.
        remaining.pop("lm_head.weight", None)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        _set(layer.input_norm, "weight", take(p + "input_layernorm.weight"), p + "input_norm")
        _set(
            layer.post_attn_norm, "weight", take(p + "post_attention_layernorm.weight"), p + "post"
        )
        attn, mlp = layer.attn, layer.mlp
        qkv = [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        _set(attn, "qkv_weight", torch.cat(qkv), p + "self_attn.qkv")
        if attn.qkv_bias is not None:
            bias = [take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
            _set(attn, "qkv_bias", torch.cat(bias), p + "self_attn.qkv bias")
        _set(attn, "o_weight", take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj")
        if attn.o_bias is not None:
            _set(attn, "o_bias", take(p + "self_attn.o_proj.bias"), p + "self_attn.o bias")
        gate_up = [take(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
        _set(mlp, "gate_up_weight", torch.cat(gate_up), p + "mlp.gate_up")
        _set(mlp, "down_weight", take(p + "mlp.down_proj.weight"), p + "mlp.down_proj")
    # Rotary inverse frequencies are recomputed from the config, never taken from a checkpoint.
    unset = [n for n, param in model.named_parameters() if param.is_meta]
    if unset:
        raise ValueError(f"no checkpoint tensor for parameters {unset[:5]}")
    unused = [n for n in remaining if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"checkpoint has tensors the model does not use: {sorted(unused)[:5]}")


def _set(module: nn.Module, attr: str, value: torch.Tensor, name: str) -> None:
    # Adopt the loaded tensor instead of copying into a preallocated one: the model can then be
    # built on the meta device, and a 0.5 GB checkpoint is not copied twice.
    param = getattr(module, attr)
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {value.dtype}")
    setattr(module, attr, nn.Parameter(value, requires_grad=False))


def assign_mapped_weights(model: nn.Module, mapped: MappedGGUF) -> None:
    """Give ``model`` a mapped GGUF file's weights (engine/weights/gguf_blocks.py): block
    matrices as they are (q/k/v and gate/up stacked, not copied), float tensors adopted.
    llama.cpp's llama converter interleaves Q/K rotary rows; those rows are put back in
    rotate-half order (a copy of q and k only). Raises ValueError on a missing or misshapen
    tensor."""
    config = mapped.config
    weights: dict[str, torch.Tensor | BlockQuantWeight] = {**mapped.dense, **mapped.blocks}
    is_permuted = config.architecture == "llama"

    def take(name: str, heads: int | None = None) -> torch.Tensor | BlockQuantWeight:
        if name not in weights:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        w = weights.pop(name)
        if not (is_permuted and heads):
            return w
        if isinstance(w, BlockQuantWeight):
            return w.select_rows(_rotary_order(w.shape[0], heads))
        return torch.from_numpy(unpermute_rotary_rows(w.numpy(), heads))

    _put(model, "embed_weight", take("model.embed_tokens.weight"))
    _put(model.norm, "weight", take("model.norm.weight"))
    if model.lm_head_weight is not None:
        _put(model, "lm_head_weight", take("lm_head.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.attn, layer.mlp
        _put(layer.input_norm, "weight", take(p + "input_layernorm.weight"))
        _put(layer.post_attn_norm, "weight", take(p + "post_attention_layernorm.weight"))
        heads = {"q": config.num_heads, "k": config.num_kv_heads, "v": None}
        qkv = [take(f"{p}self_attn.{n}_proj.weight", heads[n]) for n in "qkv"]
        _put(attn, "qkv_weight", _stacked(qkv))
        if attn.qkv_bias is not None:
            bias = [take(f"{p}self_attn.{n}_proj.bias", heads[n]) for n in "qkv"]
            _put(attn, "qkv_bias", torch.cat(bias))  # type: ignore[arg-type]
        _put(attn, "o_weight", take(p + "self_attn.o_proj.weight"))
        if attn.o_bias is not None:
            _put(attn, "o_bias", take(p + "self_attn.o_proj.bias"))
        _put(
            mlp,
            "gate_up_weight",
            _stacked([take(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]),
        )
        _put(mlp, "down_weight", take(p + "mlp.down_proj.weight"))
    weights.pop("lm_head.weight", None)  # a tied file may still carry a head of its own
    if weights:
        raise ValueError(f"checkpoint has tensors the model does not use: {sorted(weights)[:5]}")


def _rotary_order(rows: int, num_heads: int) -> torch.Tensor:
    order = unpermute_rotary_rows(np.arange(rows)[:, None], num_heads)[:, 0]
    return torch.from_numpy(order.astype(np.int64))


def _stacked(parts: list) -> torch.Tensor | BlockQuantWeight | BlockStack:
    """Parts along N: blocks stacked (or fused, for plane parts), float tensors concatenated; a
    mix (a float part beside block parts) is widened to float32 whole."""
    if all(isinstance(p, BlockQuantWeight) for p in parts):
        return stack_or_fuse(parts)
    return torch.cat(
        [block_quant_dequantize(p) if isinstance(p, BlockQuantWeight) else p for p in parts]
    )


def _put(module: nn.Module, attr: str, value: object) -> None:
    current = getattr(module, attr)
    if tuple(current.shape) != tuple(value.shape):  # type: ignore[attr-defined]
        raise ValueError(f"{attr}: expected shape {tuple(current.shape)}, got {tuple(value.shape)}")  # type: ignore[attr-defined]
    if isinstance(value, torch.Tensor):
        setattr(module, attr, nn.Parameter(value.float(), requires_grad=False))
        return
    if attr in module._parameters:
        delattr(module, attr)
    setattr(module, attr, value)
