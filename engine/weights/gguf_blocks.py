"""The matmul weights of a GGUF file kept in the file's own blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K).

These stand for exactly the float32 matrices :func:`engine.weights.gguf_loader.load_gguf`
dequantizes, under the model's fused names (q/k/v in one matrix, gate/up in another, Q/K rows
in rotate-half order), so swapping them in changes the bytes a decode step reads, not the model.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.weights.gguf_loader import unpermute_rotary_rows
from prefixrag.kernels.block_quant_matmul import MAX_K, BlockQuantWeight
from prefixrag.kernels.gguf_planes import SUPPORTED_GGUF_TYPES, from_gguf_blocks


def _rotary_row_order(rows: int, num_heads: int) -> torch.Tensor:
    order = unpermute_rotary_rows(np.arange(rows)[:, None], num_heads)[:, 0]
    return torch.from_numpy(order.astype(np.int64))


def load_gguf_block_weights(path: str, config: ModelConfig) -> dict[str, BlockQuantWeight]:
    """Block weights by model attribute (``layers.3.attn.qkv_weight``, ``lm_head_weight``).

    A matrix is left out (it stays float32) when any of its parts is in a block format the kernel
    lacks, or is wider than the kernel's row buffer (``MAX_K``).
    """
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    is_permuted = config.architecture == "llama"

    def block(name: str, num_heads: int | None = None) -> BlockQuantWeight | None:
        t = raw.get(name)
        if t is None or t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
            return None
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dims innermost first
        if shape[1] > MAX_K:
            return None
        w = from_gguf_blocks(t.data, t.tensor_type.name, shape)
        if is_permuted and num_heads is not None:
            w = w.select_rows(_rotary_row_order(shape[0], num_heads))
        return w

    def fused(*parts: BlockQuantWeight | None) -> BlockQuantWeight | None:
        if any(p is None for p in parts) or not BlockQuantWeight.can_fuse(list(parts)):  # type: ignore[arg-type]
            return None
        return BlockQuantWeight.cat(list(parts))  # type: ignore[arg-type]

    out: dict[str, BlockQuantWeight | None] = {}
    for i in range(config.num_layers):
        p = f"blk.{i}."
        out[f"layers.{i}.attn.qkv_weight"] = fused(
            block(p + "attn_q.weight", config.num_heads),
            block(p + "attn_k.weight", config.num_kv_heads),
            block(p + "attn_v.weight"),
        )
        out[f"layers.{i}.attn.o_weight"] = block(p + "attn_output.weight")
        out[f"layers.{i}.mlp.gate_up_weight"] = fused(
            block(p + "ffn_gate.weight"), block(p + "ffn_up.weight")
        )
        out[f"layers.{i}.mlp.down_weight"] = block(p + "ffn_down.weight")
    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    out["lm_head_weight"] = block(head)
    return {name: w for name, w in out.items() if w is not None}
