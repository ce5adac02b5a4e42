"""GGUF files that leave out the optional metadata keys load as llama.cpp loads them.

Real files often lack ``<arch>.vocab_size`` (Qwen2.5's do), ``rope.freq_base``,
``attention.key_length`` and the like. Tiny random Llama / Qwen2 / Mistral models are written
twice, once with every key and once with only the ones llama.cpp cannot do without; both must
give the same config and the same logits, and those logits must match transformers.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.engine.tokenizer import Tokenizer, _byte_level_decoder
from prefixrag.engine.weights.gguf_loader import (
    gguf_array_length,
    gguf_model_config,
    load_gguf,
    read_gguf_metadata,
)

ATOL = RTOL = 2e-4  # fp32 on both sides; only summation order may differ
VOCAB = 300
# The values llama.cpp assumes when the keys are absent, so that the reference model agrees.
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
# architecture -> (HF config class, HF model class, kv heads, tied embeddings). qwen2 has the
# Qwen2.5-0.5B shape (GQA, tied, q/k/v biases); mistral is MHA, so its file can drop
# head_count_kv as well (with GQA that key is not optional: llama.cpp defaults it to head_count).
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, 2, False),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, 2, True),
    "mistral": (MistralConfig, MistralForCausalLM, 4, False),
}
GGUF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 style BPE vocabulary of VOCAB tokens: 256 bytes, a few merges, three special
    tokens, then [PAD] tokens, padded the way convert_hf_to_gguf pads Qwen2's list."""
    to_char = {b: c for c, b in _byte_level_decoder().items()}
    tokens = [to_char[b] for b in range(256)]
    pairs = [("t", "h"), ("h", "e"), ("th", "e"), ("Ġ", "t"), ("i", "n"), ("Ġ", "in")]
    merges = [f"{a} {b}" for a, b in pairs]
    tokens += [a + b for a, b in pairs] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # normal, control
    pads = VOCAB - len(tokens)
    return tokens + [f"[PAD{i}]" for i in range(pads)], types + [4] * pads, merges


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (its llama converter only)."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def make_reference(arch: str) -> torch.nn.Module:
    config_cls, model_cls, kv_heads, tied = MODELS[arch]
    extra = {"sliding_window": None} if arch == "mistral" else {}
    config = config_cls(**SIZES, num_key_value_heads=kv_heads, tie_word_embeddings=tied, **extra)
    model = model_cls(config).eval()
    # Default init leaves norms at 1 and biases at 0; random values make every weight matter.
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return model


def write_gguf(
    path: str,
    arch: str,
    model: torch.nn.Module,
    *,
    all_keys: bool,
    with_tokens: bool = True,
    vocab_key: int | None = None,
    quant: gguf.GGMLQuantizationType | None = None,
) -> str:
    """Write ``model`` as llama.cpp would; without ``all_keys`` only the keys llama.cpp cannot
    derive are written (and head_count_kv where it differs from head_count)."""
    _, _, kv_heads, tied = MODELS[arch]
    heads, hidden = SIZES["num_attention_heads"], SIZES["hidden_size"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(SIZES["num_hidden_layers"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(SIZES["intermediate_size"])
    writer.add_head_count(heads)
    if all_keys or kv_heads != heads:
        writer.add_head_count_kv(kv_heads)
    if all_keys or vocab_key is not None:
        writer.add_vocab_size(VOCAB if vocab_key is None else vocab_key)
    if all_keys:
        writer.add_context_length(SIZES["max_position_embeddings"])
        writer.add_key_length(hidden // heads)
        writer.add_value_length(hidden // heads)
        writer.add_rope_dimension_count(hidden // heads)
        writer.add_rope_freq_base(SIZES["rope_theta"])
        writer.add_layer_norm_rms_eps(SIZES["rms_norm_eps"])
    if with_tokens:
        tokens, types, merges = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))

    def add(name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        if quant is None or array.ndim == 1:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if not tied:
        add("output.weight", state["lm_head.weight"])
    for i in range(SIZES["num_hidden_layers"]):
        for hf, gg in GGUF_LAYER_NAMES.items():
            if f"model.layers.{i}.{hf}" not in state:
                continue  # biases: qwen2 only
            array = state[f"model.layers.{i}.{hf}"]
            if arch == "llama" and gg.startswith("attn_q."):
                array = llama_cpp_permute(array, heads)
            elif arch == "llama" and gg.startswith("attn_k."):
                array = llama_cpp_permute(array, kv_heads)
            add(f"blk.{i}.{gg}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def config_of(path: str) -> ModelConfig:
    return gguf_model_config(gguf.GGUFReader(path))


def prompt_logits(path: str, weight_quant: str = "none") -> tuple[torch.Tensor, list[int]]:
    runner = ModelRunner(
        EngineConfig(
            model=str(path),
            block_size=4,
            num_kv_blocks=16,
            weight_quant=weight_quant,
            kv_cache_dtype="float32",
        )
    )
    ids = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    return runner.run([StepItem(ids, 0, list(range(15, 9, -1)), True)], all_logits=True), ids


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    reference = make_reference(arch)
    full = write_gguf(str(folder / "full.gguf"), arch, reference, all_keys=True)
    minimal = write_gguf(str(folder / "minimal.gguf"), arch, reference, all_keys=False)
    return arch, reference, full, minimal


def test_minimal_file_derives_the_full_files_config(case):
    arch, reference, full, minimal = case
    derived, written = config_of(minimal), config_of(full)
    # GGUF stores the epsilon as float32, so the written 1e-5 reads back a hair off.
    assert written.rms_norm_eps == pytest.approx(1e-5)
    assert replace(written, rms_norm_eps=derived.rms_norm_eps) == derived
    assert derived == ModelConfig.from_hf_config(reference.config.to_dict())
    _, _, kv_heads, tied = MODELS[arch]
    assert derived.vocab_size == VOCAB  # the token list's length: no <arch>.vocab_size key
    assert (derived.head_dim, derived.num_kv_heads) == (16, kv_heads)
    assert (derived.rope_theta, derived.rms_norm_eps) == (10000.0, 1e-5)
    assert derived.max_position_embeddings == 2048
    assert derived.tie_word_embeddings is tied
    assert derived.attention_bias is (arch == "qwen2")


def test_minimal_file_logits_match_the_full_file_and_transformers(case):
    _, reference, full, minimal = case
    ours, ids = prompt_logits(minimal)
    again, _ = prompt_logits(full)
    torch.testing.assert_close(ours, again)  # float32 tolerance: the written eps is rounded
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)


def test_vocab_comes_from_the_embedding_shape_without_a_token_list(case, tmp_path):
    arch, reference, _, minimal = case
    bare = write_gguf(
        str(tmp_path / "bare.gguf"), arch, reference, all_keys=False, with_tokens=False
    )
    reader = gguf.GGUFReader(bare)
    assert "tokenizer.ggml.tokens" not in reader.fields
    assert gguf_model_config(reader) == config_of(minimal)
    torch.testing.assert_close(prompt_logits(bare)[0], prompt_logits(minimal)[0], rtol=0, atol=0)


def test_tokenizer_of_a_file_without_vocab_size_key(tmp_path):
    # The Qwen2.5 case: a padded token list and no qwen2.vocab_size.
    path = write_gguf(str(tmp_path / "q.gguf"), "qwen2", make_reference("qwen2"), all_keys=False)
    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.vocab_size == config_of(path).vocab_size == VOCAB
    ids = tokenizer.encode("the thin<|im_end|>")
    assert ids[-1] == tokenizer.backend.token_to_id("<|im_end|>") and max(ids) < VOCAB
    assert tokenizer.decode(ids) == "the thin<|im_end|>"


def test_tied_block_weights_of_a_minimal_quantized_file(tmp_path):
    # The block kernel reads lm_head from token_embd when the derived config says "tied".
    reference = make_reference("qwen2")
    path = write_gguf(
        str(tmp_path / "q8.gguf"),
        "qwen2",
        reference,
        all_keys=False,
        quant=gguf.GGMLQuantizationType.Q8_0,
    )
    assert config_of(path).tie_word_embeddings
    blocks, _ = prompt_logits(path, weight_quant="gguf")
    dense, _ = prompt_logits(path, weight_quant="none")
    torch.testing.assert_close(blocks, dense, atol=ATOL, rtol=RTOL)


def test_token_count_is_the_array_length_not_its_parts(case):
    _, _, _, minimal = case
    reader = gguf.GGUFReader(minimal)
    field = reader.fields["tokenizer.ggml.tokens"]
    # parts: key length, key, type, item type, count, then a length and a body per string.
    assert len(field.parts) == 5 + 2 * VOCAB
    assert gguf_array_length(reader, "tokenizer.ggml.tokens") == VOCAB
    assert gguf_array_length(reader, "tokenizer.ggml.no_such_key") is None
    # The metadata the loader reads leaves the big list out, so the count must come separately.
    assert "tokenizer.ggml.tokens" not in read_gguf_metadata(reader)


def test_vocab_size_key_that_disagrees_with_the_embedding_is_refused(tmp_path):
    path = str(tmp_path / "bad.gguf")
    write_gguf(path, "llama", make_reference("llama"), all_keys=False, vocab_key=VOCAB - 1)
    with pytest.raises(ValueError, match=rf"token_embd\.weight has {VOCAB} rows"):
        load_gguf(path)


def from_keys(keys: dict[str, object], arch: str = "llama", **hints: int) -> ModelConfig:
    """Config of a metadata dict holding ``keys`` (``<arch>.`` added unless ``tokenizer.``)
    on top of the keys llama.cpp requires."""
    meta: dict[str, object] = {
        "general.architecture": arch,
        f"{arch}.block_count": 2,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 96,
        f"{arch}.attention.head_count": 4,
    }
    for key, value in keys.items():
        meta[key if key.startswith("tokenizer.") else f"{arch}.{key}"] = value
    return ModelConfig.from_gguf_metadata(meta, has_output_weight=True, **hints)


def test_metadata_defaults_follow_llama_cpp():
    config = from_keys({}, embedding_rows=77)
    assert config.vocab_size == 77
    assert (config.head_dim, config.num_kv_heads, config.rope_theta) == (16, 4, 10000.0)
    assert (config.rms_norm_eps, config.max_position_embeddings) == (1e-5, 2048)
    assert config.rope_scaling.rope_type == "default"
    # vocabulary precedence: the explicit key, then the token list, then the embedding's rows
    assert from_keys({"vocab_size": 5}, token_count=6, embedding_rows=7).vocab_size == 5
    assert from_keys({"tokenizer.ggml.tokens": ["a"] * 6}, embedding_rows=7).vocab_size == 6
    assert from_keys({}, token_count=6, embedding_rows=7).vocab_size == 6
    with pytest.raises(ValueError, match=r"no llama\.vocab_size"):
        from_keys({})


def test_head_dim_comes_from_key_length_and_rope_must_cover_it():
    assert from_keys({"attention.key_length": 32}, token_count=9).head_dim == 32
    with pytest.raises(ValueError, match="partial rotary"):
        from_keys({"rope.dimension_count": 8}, token_count=9)
    with pytest.raises(ValueError, match="value length"):
        from_keys({"attention.value_length": 8}, token_count=9)


def test_rope_scaling_and_context_keys():
    # llama.cpp reads a factor without a type as linear, and knows the old scale_linear key.
    old = from_keys({"rope.scale_linear": 4.0}, token_count=9).rope_scaling
    assert (old.rope_type, old.factor) == ("linear", 4.0)
    off = from_keys({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, token_count=9)
    assert off.rope_scaling.rope_type == "default"
    # No sliding-window attention here: a Mistral context is capped at its window (as from HF).
    window = {"context_length": 32768, "attention.sliding_window": 4096}
    assert from_keys(window, "mistral", token_count=9).max_position_embeddings == 4096
    assert from_keys(window, "llama", token_count=9).max_position_embeddings == 32768


def test_packaged_model_config_is_unchanged():
    reader = gguf.GGUFReader(packaged_llm_path())
    config = gguf_model_config(reader)
    # This file has llama.vocab_size, so the metadata alone gives the config, as it always did.
    assert config == ModelConfig.from_gguf_metadata(
        read_gguf_metadata(reader), has_output_weight=False
    )
    assert (config.architecture, config.vocab_size, config.head_dim) == ("llama", 49152, 64)
    assert (config.num_heads, config.num_kv_heads, config.num_layers) == (9, 3, 30)
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192
    assert config.rope_theta == 100000.0
