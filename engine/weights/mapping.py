"""Copy Hugging Face-named tensors into :class:`engine.model.LlamaModel`'s fused parameters.

The model is typed as a plain nn.Module: model.py imports this module, so naming its class here
would make an import loop."""

from __future__ import annotations

import torch
from torch import nn


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
