"""Weight loading: GGUF name mapping and rotary un-permutation, HF directories."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.weights import load_checkpoint
from prefixrag.engine.weights.gguf_loader import unpermute_rotary_rows

TINY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,
}
GGUF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation, written out from its definition."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def tiny_hf_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_tiny_gguf(path: str, state: dict[str, torch.Tensor]) -> None:
    """Write the HF weights as llama.cpp would: GGUF names, Q/K rows permuted, float32."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    writer.add_vocab_size(TINY["vocab_size"])
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    for i in range(TINY["num_hidden_layers"]):
        for hf, gg in GGUF_LAYER_NAMES.items():
            array = state[f"model.layers.{i}.{hf}"].numpy()
            if gg == "attn_q.weight":
                array = llama_cpp_permute(array, TINY["num_attention_heads"])
            elif gg == "attn_k.weight":
                array = llama_cpp_permute(array, TINY["num_key_value_heads"])
            writer.add_tensor(f"blk.{i}.{gg}", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    return tiny_hf_state_dict()


@pytest.fixture
def tiny_gguf(tmp_path, tiny_state) -> str:
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, tiny_state)
    return path


@pytest.mark.parametrize(("num_heads", "rows", "cols"), [(4, 64, 8), (3, 192, 5), (1, 2, 3)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads, rows, cols):
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    np.testing.assert_array_equal(
        unpermute_rotary_rows(llama_cpp_permute(w, num_heads), num_heads), w
    )


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ValueError, match="rotary pairs"):
        unpermute_rotary_rows(np.zeros((6, 2), np.float32), 4)


def test_gguf_loads_back_to_hf_weights_and_config(tiny_gguf, tiny_state):
    config, tensors = load_checkpoint(tiny_gguf)
    assert set(tensors) == {k for k in tiny_state if not k.endswith("inv_freq")}
    for name, value in tensors.items():
        torch.testing.assert_close(value, tiny_state[name], rtol=0, atol=0, msg=name)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
    assert config.rope_theta == TINY["rope_theta"]
    assert not config.tie_word_embeddings


def test_hf_directory_loads_config_and_tensors(tmp_path):
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    config, tensors = load_checkpoint(tmp_path)
    assert config.tie_word_embeddings and config.num_layers == 2
    expected = model.state_dict()["model.layers.1.mlp.up_proj.weight"]
    torch.testing.assert_close(tensors["model.layers.1.mlp.up_proj.weight"], expected)


def test_config_round_trips_through_dict():
    config = ModelConfig.from_hf_config(
        dict(TINY, model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0})
    )
    assert ModelConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "bad",
    [
        {"model_type": "gpt2"},
        {"num_key_value_heads": 3},
        {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    ],
)
def test_bad_configs_raise_value_error(bad):
    with pytest.raises(ValueError):
        ModelConfig.from_hf_config({**TINY, "model_type": "llama", **bad})


def test_missing_checkpoint_raises(tmp_path):
    with pytest.raises(ValueError, match="no model checkpoint"):
        load_checkpoint(tmp_path / "nope.gguf")
