"""Decode steps replayed from captured graphs (engine/decode_graphs.py).

On CPU the capture is replaced by calling the forward again on the static buffers: that checks
everything but CUDA's recording itself (the buffers, the padding rows, the batch buckets). On CUDA
the real graphs are checked against eager steps of the same runner.
"""

from __future__ import annotations

import pytest
import torch

from prefixrag.engine.config import EngineConfig
from prefixrag.engine.decode_graphs import graph_batch_sizes
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.tokenizer import Tokenizer

CONFIG = ModelConfig("llama", 2, 64, 128, 4, 2, 16, 300, 512)
BLOCK_SIZE = 16


def _runner(device: str = "cpu", backend: str = "reference", dtype: str = "float32"):
    return ModelRunner.from_config(
        CONFIG,
        Tokenizer.word_level(CONFIG.vocab_size),
        EngineConfig(
            model="<random weights>",
            num_kv_blocks=64,
            block_size=BLOCK_SIZE,
            device=device,
            dtype=dtype,
            attention_backend=backend,
            max_model_len=256,
            kv_cache_dtype=dtype,
        ),
        seed=5,
    )


def _prefill(runner: ModelRunner, num_seqs: int) -> list[tuple[list[int], list[int]]]:
    """Prefill ``num_seqs`` prompts of different lengths; returns (ids, block table) of each."""
    seqs = []
    for s in range(num_seqs):
        ids = [(7 * s + 3 * i) % 290 + 1 for i in range(20 + 9 * s)]
        blocks = [4 * s + j for j in range(4)]  # room for 64 tokens each
        runner.run([StepItem(ids, 0, blocks)])
        seqs.append((ids, blocks))
    return seqs


def _decode_items(seqs, step: int) -> list[StepItem]:
    return [StepItem([(11 * step + len(ids)) % 290 + 1], len(ids) + step, b) for ids, b in seqs]


def test_graph_batch_sizes_cover_every_batch_with_little_padding():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    for n in range(1, 65):
        size = next(b for b in graph_batch_sizes(64) if b >= n)
        assert size - n <= max(15, n)  # never more than doubles a small batch
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_replayed_decode_equals_eager_and_padding_writes_no_kv(num_seqs):
    eager, graphed = _runner(), _runner()
    graphed.capture_decode_graphs(8, capture=lambda forward: forward)
    assert graphed.decode_graphs is not None
    seqs = _prefill(eager, num_seqs)
    assert _prefill(graphed, num_seqs) == seqs
    for step in range(3):
        items = _decode_items(seqs, step)
        expected = eager.run(items)
        before = graphed.kv_pool.clone()
        got = graphed.run(items)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        # only the real rows' new slots changed: padding rows (slot -1) wrote nothing
        # pool: [2, layers, blocks, block_size, kv_heads, head_dim]
        changed = (graphed.kv_pool != before).any(dim=(0, 1, 4, 5))  # [blocks, block_size]
        written = {
            (it.block_ids[it.start_pos // BLOCK_SIZE], it.start_pos % BLOCK_SIZE) for it in items
        }
        assert {tuple(ix) for ix in changed.nonzero().tolist()} == written
    torch.testing.assert_close(graphed.kv_pool, eager.kv_pool, atol=1e-6, rtol=1e-6)


def test_steps_that_fit_no_graph_run_eagerly():
    runner = _runner()
    runner.capture_decode_graphs(2, capture=lambda forward: forward)
    calls = []
    graphs = runner.decode_graphs
    original = graphs.run
    graphs.run = lambda *a: calls.append(1) or original(*a)  # type: ignore[method-assign]
    seqs = _prefill(runner, 3)
    runner.run(_decode_items(seqs, 0))  # three sequences: more than any graph holds
    runner.run([StepItem([5, 6], 40, seqs[0][1])])  # an extend
    assert calls == []
    runner.run(_decode_items(seqs[:2], 1))
    assert calls == [1]


def test_capture_needs_cuda_and_triton():
    with pytest.raises(ValueError, match="CUDA"):
        _runner(backend="torch").capture_decode_graphs(4)
    config = EngineConfig(model="random", cuda_graphs=True)
    assert config.cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(model="random", cuda_graphs="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_matches_eager_decode():
    eager = _runner("cuda", "triton")
    graphed = _runner("cuda", "triton")
    graphed.capture_decode_graphs(8)
    seqs = _prefill(eager, 3)
    assert _prefill(graphed, 3) == seqs
    for step in range(4):
        items = _decode_items(seqs, step)
        got = graphed.run(items)
        # the graph's decode kernel splits the context by the table's full width, the eager one
        # by this step's: the same attention, summed in another order (TF32 dots)
        torch.testing.assert_close(got, eager.run(items), atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_with_graphs_generates_what_it_generates_without():
    outputs = []
    for graphs in (False, True):
        runner = _runner("cuda", "triton")
        config = EngineConfig(
            model="random",
            block_size=BLOCK_SIZE,
            num_kv_blocks=runner.num_blocks,
            max_num_seqs=4,
            device="cuda",
            cuda_graphs=graphs,
        )
        engine = LLMEngine(config, runner=runner)
        assert (runner.decode_graphs is not None) == graphs
        prompts = [[(5 * s + i) % 290 + 1 for i in range(30 + s)] for s in range(3)]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outputs.append([r.token_ids for r in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]
