"""The mapped GGUF load: the file's blocks as weights, checked against the float32 load of the
same file, and the memory it takes, the bytes it writes and the files it refuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.memory_plan import MemoryPlan, MemoryPlanError
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.engine.weights import map_gguf
from prefixrag.kernels.block_quant_matmul import BlockQuantWeight, simd_lanes
from prefixrag.kernels.block_stack import BlockStack
from tests.kernels.test_block_quant_matmul import random_gguf_blocks

# a Qwen2-shaped decoder whose widths are whole K-quant super-blocks
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 320, 2
HEAD_DIM = HIDDEN // HEADS


def _quantized(gguf_type: str, n: int, k: int, seed: int, scale: float = 1.0) -> np.ndarray:
    if gguf_type == "Q2_K":  # a type the engine does not run: its bytes never matter
        return np.zeros((n, k // 256 * 84), np.uint8)
    raw = random_gguf_blocks(gguf_type, n, k, seed)
    if gguf_type in ("Q4_K", "Q6_K") and scale != 1.0:
        # shrink the fp16 super-block scales so activations stay in range across layers
        size = 144 if gguf_type == "Q4_K" else 210
        blocks = raw.reshape(n, k // 256, size)
        spots = [slice(0, 2), slice(2, 4)] if gguf_type == "Q4_K" else [slice(208, 210)]
        for spot in spots:
            half = blocks[..., spot].copy().view(np.float16)
            blocks[..., spot] = (half * np.float16(scale)).view(np.uint8)
    return raw


def write_qwen2_gguf(path: str, v_type: str = "Q6_K", extra: dict | None = None) -> None:
    """Q4_K matrices with a Q6_K v and down in places, as llama.cpp's Q4_K_M mixes them; float
    norms and q/k/v biases; a Q8_0 output head beside a Q4_K embedding."""
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    rng = np.random.default_rng(0)
    q = gguf.GGMLQuantizationType

    def matrix(name: str, gguf_type: str, n: int, k: int, seed: int) -> None:
        raw = _quantized(gguf_type, n, k, seed, scale=0.05)
        w.add_tensor(name, raw, raw_dtype=q[gguf_type])

    matrix("token_embd.weight", "Q4_K", VOCAB, HIDDEN, 1)
    matrix("output.weight", "Q8_0", VOCAB, HIDDEN, 2)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        kv = KV_HEADS * HEAD_DIM
        matrix(p + "attn_q.weight", "Q4_K", HIDDEN, HIDDEN, 10 + i)
        matrix(p + "attn_k.weight", "Q4_K", kv, HIDDEN, 20 + i)
        matrix(p + "attn_v.weight", v_type if i == 0 else "Q4_K", kv, HIDDEN, 30 + i)
        matrix(p + "attn_output.weight", "Q4_K", HIDDEN, HIDDEN, 40 + i)
        matrix(p + "ffn_gate.weight", "Q4_K", INTER, HIDDEN, 50 + i)
        matrix(p + "ffn_up.weight", "Q4_K", INTER, HIDDEN, 60 + i)
        matrix(p + "ffn_down.weight", "Q6_K" if i == 1 else "Q4_K", HIDDEN, INTER, 70 + i)
        for name, size in (("attn_q", HIDDEN), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(p + name + ".bias", rng.normal(0, 0.1, size).astype(np.float32))
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            w.add_tensor(p + name, rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    for name, (raw, dtype) in (extra or {}).items():
        w.add_tensor(name, raw, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("mapped") / "qwen2-q4_k_m.gguf")
    write_qwen2_gguf(path)
    return path


def test_k_quant_matrices_are_views_of_the_file(qwen2_gguf):
    mapped = map_gguf(qwen2_gguf)
    q = mapped.blocks["model.layers.0.self_attn.q_proj.weight"]
    assert q.kind == "q4_k" and isinstance(q.codes, torch.Tensor)
    assert mapped.blocks["model.layers.0.self_attn.v_proj.weight"].kind == "q6_k"
    assert mapped.blocks["lm_head.weight"].kind == "q8"  # Q8_0 rides on planes
    file_bytes = np.asarray(mapped.file.data)
    start, end = file_bytes.ctypes.data, file_bytes.ctypes.data + file_bytes.size
    for name, w in mapped.blocks.items():
        if w.is_kquant:
            assert start <= w.codes.data_ptr() < end, f"{name} is not a view into the map"
    assert mapped.mapped_bytes > mapped.copied_bytes


def test_mapped_model_gives_the_float32_loads_logits(qwen2_gguf):
    mapped = ModelRunner(
        EngineConfig(
            model=str(qwen2_gguf),
            num_kv_blocks=16,
            weight_quant="gguf",
            int8_activations=False,
            kv_cache_dtype="float32",
        ),
        dense_prefill_bytes=0,
    )
    dense = ModelRunner(
        EngineConfig(
            model=str(qwen2_gguf), num_kv_blocks=16, weight_quant="none", kv_cache_dtype="float32"
        )
    )
    attn = mapped.model.layers[0].attn
    assert isinstance(attn.qkv_weight, BlockStack)  # Q4_K q, k beside a Q6_K v
    assert [p.kind for p in attn.qkv_weight.parts] == ["q4_k", "q4_k", "q6_k"]
    assert isinstance(mapped.model.embed_weight, BlockQuantWeight)
    assert mapped.decode_stack is not None
    prompt = [5, 17, 200, 3, 99, 41, 7, 250, 12, 60, 31, 8, 2, 300, 77, 19, 44]
    logits = {}
    for name, runner in (("mapped", mapped), ("dense", dense)):
        out = [runner.run([StepItem(prompt, 0, [0, 1])])[0]]
        token = int(out[-1].argmax())
        for step in range(6):  # decode through the C step over the mapped file's rows
            out.append(runner.run([StepItem([token], len(prompt) + step, [0, 1])])[0])
            token = int(out[-1].argmax())
        logits[name] = torch.stack(out)
    torch.testing.assert_close(logits["mapped"], logits["dense"], atol=2e-3, rtol=2e-3)
    assert torch.equal(logits["mapped"].argmax(-1), logits["dense"].argmax(-1))


def _decode_logits(runner: ModelRunner, prompt: list[int], steps: int) -> torch.Tensor:
    out = [runner.run([StepItem(prompt, 0, [0, 1])])[0]]
    for step in range(steps):
        token = int(out[-1].argmax())
        out.append(runner.run([StepItem([token], len(prompt) + step, [0, 1])])[0])
    return torch.stack(out)


def test_int8_activations_on_file_rows_agree_between_the_c_step_and_torch(qwen2_gguf):
    """With int8 activations the C decode step quantizes x per super-block for the Q4_K / Q6_K
    parts as the torch model's matmuls do (q8k_act.h): the same logits up to upstream float
    order, and near the float32 path's."""
    prompt = [5, 17, 200, 3, 99, 41, 7, 250, 12, 60, 31, 8, 2, 300, 77, 19, 44]
    runs = {}
    for name, backend, q8 in (
        ("c", "native", True),
        ("torch", "torch", True),
        ("f32", "native", False),
    ):
        runner = ModelRunner(
            EngineConfig(
                model=str(qwen2_gguf),
                num_kv_blocks=16,
                weight_quant="gguf",
                attention_backend=backend,
                int8_activations=q8,
                kv_cache_dtype="float32",
            )
        )
        assert runner.int8_activations == q8
        runs[name] = _decode_logits(runner, prompt, 6)
    assert (runs["c"] - runs["f32"]).abs().max() > 0.1  # the int8 path did run
    cos = torch.nn.functional.cosine_similarity
    assert cos(runs["c"], runs["f32"], dim=-1).min() > 0.999
    assert torch.equal(runs["c"].argmax(-1), runs["torch"].argmax(-1))
    if simd_lanes() != 16:
        # measured on AVX2 builds: 2e-5 apart at most, where int8 against float32 is 3 apart
        # (logits up to 131)
        torch.testing.assert_close(runs["c"], runs["torch"], atol=2e-4, rtol=1e-5)
        return

    # AVX-512 builds, measured on a 2-core Zen 5: 1.0% of the logits' norm apart, against 2.7%
    # between int8 and float32 (the same host's AVX2 build: 2e-5 apart). The float work before
    # each rounding to int8 (norms, attention) is compiled apart in the C step and in torch;
    # where it sums in another order, elements near a half step round to another code.
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())

    assert rel(runs["c"], runs["torch"]) < 0.5 * rel(runs["c"], runs["f32"])
    assert cos(runs["c"], runs["torch"], dim=-1).min() > 0.9999


def test_nothing_is_written_for_the_weights(qwen2_gguf, tmp_path):
    ModelRunner(
        EngineConfig(
            model=str(qwen2_gguf),
            num_kv_blocks=4,
            cache_dir=str(tmp_path),
            kv_cache_dtype="float32",
        )
    )
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_file_is_refused_by_tensor(qwen2_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = Path(qwen2_gguf).read_bytes()
    cut.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ValueError, match=r"(runs past the end|not a readable GGUF)"):
        map_gguf(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        map_gguf(junk)


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path):
    path = str(tmp_path / "q2k.gguf")
    q2k = np.zeros((HIDDEN, 84 * HIDDEN // 256), np.uint8)  # Q2_K: 84 bytes a super-block
    extra = {"blk.0.ffn_extra.weight": (q2k, gguf.GGMLQuantizationType.Q2_K)}
    write_qwen2_gguf(path, extra=extra)
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        map_gguf(path)
    path2 = str(tmp_path / "q2k-down.gguf")
    write_qwen2_gguf(path2, v_type="Q2_K")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight: tensor type Q2_K .*Q4_K"):
        map_gguf(path2)


def test_a_model_that_cannot_fit_is_refused_before_its_pool(qwen2_gguf):
    with pytest.raises(MemoryPlanError, match=r"does not fit.*PREFIXRAG_KV_CACHE_GB"):
        ModelRunner(
            EngineConfig(
                model=str(qwen2_gguf), kv_cache_gb=(1 << 30) / 2**30, kv_cache_dtype="float32"
            ),
            memory_limit_bytes=256 << 20,
        )
    runner = ModelRunner(
        EngineConfig(model=str(qwen2_gguf), kv_cache_dtype="float32"), memory_limit_bytes=2 << 30
    )
    plan = runner.memory_plan
    assert plan.kv_pool == runner.num_blocks * runner.block_size * runner.kv_bytes_per_token
    assert plan.weights_mapped > 0 and plan.total <= plan.available


def test_the_kv_pool_takes_what_is_left():
    plan = MemoryPlan(10, 20, 0, 0, 30, 40, available=1000, runtime=0)
    assert plan.total == 100
    from prefixrag.engine.memory_plan import kv_budget_from_left

    assert kv_budget_from_left(1000, 100, fraction=0.5, cap=10_000, floor=1) == 450
    assert kv_budget_from_left(1000, 100, fraction=0.5, cap=200, floor=1) == 200
    assert kv_budget_from_left(50, 100, fraction=0.5, cap=200, floor=16) == 16


_PEAK_RSS = """
import sys
import torch
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.model_runner import ModelRunner

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

before = hwm()
ModelRunner(EngineConfig(model=sys.argv[1], num_kv_blocks=8), dense_prefill_bytes=0)
print(before, hwm())
"""


def test_loading_the_packaged_model_peaks_below_its_float32_size():
    # the loader of before widened every tensor to float32 first: 4 bytes a weight for that
    # dict alone, over the bound below; the mapped load holds the planes (0.75 bytes a Q4_1
    # weight), the file's pages it read them from, and numpy's passing copies
    path = packaged_llm_path()
    mapped = map_gguf(path)
    num_weights = sum(w.shape[0] * w.shape[1] for w in mapped.blocks.values())
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(path)], capture_output=True, text=True, check=True
    )
    before, after = map(int, out.stdout.split())
    assert after - before < 3 * num_weights, (before, after, num_weights)
