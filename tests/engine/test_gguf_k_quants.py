"""Q4_K_M and Q5_K_M files from llama.cpp's own quantizer on the block path, bit for bit with
gguf-py's dequantization and with the float32 load.

llama.cpp lives in the benchmark's venv (bash bench/setup_peers.sh; PREFIXRAG_PEERS_VENV moves
it); without it these tests skip, and tests/kernels covers Q4_K with blocks written by hand.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bench.requantize import PeerMissing, requantize
from prefixrag.engine.weights import map_gguf
from prefixrag.engine.weights.gguf_loader import load_gguf, unpermute_rotary_rows
from prefixrag.kernels.block_quant_matmul import block_quant_dequantize
from prefixrag.kernels.gguf_planes import SUPPORTED_GGUF_TYPES, from_gguf_blocks

# the file type, and the types of its 1,536-wide ffn_down (a K-quant and Q6_K in places)
FILE_TYPES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}}
# the file's own rows for Q4_K and Q6_K, planes for Q5_K
KIND_OF = {"Q4_K": "q4_k", "Q5_K": "q8m", "Q6_K": "q6_k"}


@pytest.fixture(scope="module", params=list(FILE_TYPES))
def k_quant_path(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("k_quants") / f"model.{request.param}.gguf"
    try:
        requantize(request.param, out)
    except PeerMissing as err:
        pytest.skip(str(err))
    return str(out)


def test_block_tensors_repack_bit_for_bit(k_quant_path):
    # llama.cpp gives K-quants only to rows that are whole super-blocks (K % 256 == 0, here the
    # 1,536-wide ffn_down); the 576-wide rest falls back to Q5_0, Q5_1 or Q8_0
    reader = gguf.GGUFReader(k_quant_path)
    types = {t.tensor_type.name for t in reader.tensors}
    assert "Q6_K" in types and types & {"Q4_K", "Q5_K"}
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
            continue
        n, k = int(t.shape[1]), int(t.shape[0])
        expected = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = from_gguf_blocks(t.data, t.tensor_type.name, (n, k))
        assert torch.equal(block_quant_dequantize(w), torch.from_numpy(expected)), t.name


def test_block_weights_are_the_dense_load(k_quant_path):
    _, dense = load_gguf(k_quant_path)
    mapped = map_gguf(k_quant_path)
    reader = gguf.GGUFReader(k_quant_path)
    down_types = {
        int(t.name.split(".")[1]): t.tensor_type.name
        for t in reader.tensors
        if t.name.endswith("ffn_down.weight")
    }
    assert set(down_types.values()) in FILE_TYPES.values()
    for i, gguf_type in down_types.items():
        assert mapped.blocks[f"model.layers.{i}.mlp.down_proj.weight"].kind == KIND_OF[gguf_type]
    # every matrix stays in blocks, and each is the matrix the dense load widens
    assert len(mapped.blocks) == 7 * mapped.config.num_layers + 1
    heads = {"q_proj": mapped.config.num_heads, "k_proj": mapped.config.num_kv_heads}
    for name, w in mapped.blocks.items():
        got = block_quant_dequantize(w)
        proj = name.split(".")[-2]
        if proj in heads:  # the file keeps llama.cpp's rotary row order; the model restores it
            got = torch.from_numpy(unpermute_rotary_rows(got.numpy(), heads[proj]))
        assert torch.equal(got, dense[name]), name
