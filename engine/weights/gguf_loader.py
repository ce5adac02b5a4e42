"""Read a Llama-family GGUF file: its metadata, and its tensors dequantized under HF names."""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch

from prefixrag.engine.model_config import ModelConfig

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Large token lists are read only by the tokenizer, which asks for them by name.
_ARRAY_KEYS_SKIPPED = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


def read_gguf_metadata(reader: gguf.GGUFReader, *, with_vocab: bool = False) -> dict[str, Any]:
    """All key/values of a GGUF file as Python values (the vocabulary only if asked)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or (key in _ARRAY_KEYS_SKIPPED and not with_vocab):
            continue
        meta[key] = field.contents()
    return meta


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3...``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs) back to rotate-half order.

    llama.cpp's converter reorders each head's rows from [first half, second half] into
    interleaved pairs; this puts them back so the model can use HF's rotate-half RoPE.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of rotary pairs")
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


def gguf_array_length(reader: gguf.GGUFReader, key: str) -> int | None:
    """Element count of an array field without decoding it, or None when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    # ReaderField.data holds one index into .parts per array element; .parts also holds the
    # header (key, type, count) and, for strings, a length part per element, so len(parts) is
    # not the element count.
    return len(field.data)


def gguf_model_config(reader: gguf.GGUFReader) -> ModelConfig:
    """The model config of an open GGUF file, optional keys derived as llama.cpp does."""
    meta = read_gguf_metadata(reader)
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    return model_config_from(meta, shapes, gguf_array_length(reader, "tokenizer.ggml.tokens"))


def model_config_from(
    meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], token_count: int | None
) -> ModelConfig:
    """The model config from a file's metadata, its tensors' shapes (GGUF order, innermost
    first) and its vocabulary's length, optional keys derived as llama.cpp does."""
    embedding = shapes.get("token_embd.weight")
    # GGUF lists dims innermost first: token_embd is (hidden, vocab).
    embedding_rows = embedding[1] if embedding is not None and len(embedding) == 2 else None
    config = ModelConfig.from_gguf_metadata(
        meta,
        has_output_weight="output.weight" in shapes,
        token_count=token_count,
        embedding_rows=embedding_rows,
    )
    if embedding_rows is not None and embedding_rows != config.vocab_size:
        # llama.cpp refuses such a file too (wrong tensor shape); say which number disagrees.
        raise ValueError(
            f"token_embd.weight has {embedding_rows} rows but the GGUF metadata gives a "
            f"vocabulary of {config.vocab_size}"
        )
    return config


def load_gguf(
    path: str, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named tensors of a GGUF file, dequantized one by one to ``dtype`` (so a
    16-bit load never holds the float32 model), rotary rows restored."""
    reader = gguf.GGUFReader(path)
    config = gguf_model_config(reader)
    # Only llama.cpp's *llama* converter permutes Q/K; qwen2 files keep HF order.
    is_permuted = config.architecture == "llama"
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if is_permuted and ".attn_q." in t.name:
            array = unpermute_rotary_rows(array, config.num_heads)
        elif is_permuted and ".attn_k." in t.name:
            array = unpermute_rotary_rows(array, config.num_kv_heads)
        # dequantize returns numpy in row-major [out, in] order, which is already HF's layout.
        tensors[hf_name(t.name)] = torch.from_numpy(np.array(array, copy=True)).to(dtype)
    return config, tensors
