"""The decode bandwidth figure: which weight bytes a batch-1 step reads, and the share of a
streaming read that a tokens/s figure stands for."""

from __future__ import annotations

import pytest

from bench.decode_bandwidth import bandwidth_rows, stream_gb_per_s, weight_bytes_per_token
from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.weights import read_gguf_file
from tests.engine.test_mapped_weights import write_qwen2_gguf


def test_a_tied_head_counts_the_embedding_once_and_an_untied_one_leaves_it_out(tmp_path):
    packaged = packaged_llm_path()
    tensors = read_gguf_file(packaged).tensors
    assert "output.weight" not in {t.name for t in tensors}  # SmolLM2 ties its head
    assert weight_bytes_per_token(packaged) == sum(t.nbytes for t in tensors)
    path = str(tmp_path / "untied.gguf")
    write_qwen2_gguf(path)  # has an output.weight
    tensors = read_gguf_file(path).tensors
    embedding = next(t.nbytes for t in tensors if t.name == "token_embd.weight")
    assert weight_bytes_per_token(path) == sum(t.nbytes for t in tensors) - embedding


def test_bandwidth_rows_scale_tokens_per_second_by_the_bytes():
    metrics = {
        "decode_b1_short_tok_s": {"ours": 10.0, "theirs": 5.0},
        "cold_ttft_ms": {"ours": 1.0, "theirs": 2.0},
    }
    rows = bandwidth_rows(metrics, bytes_per_token=2_000_000_000, stream_gbps=40.0)
    assert list(rows) == ["decode_b1_short_tok_s"]
    assert rows["decode_b1_short_tok_s"]["ours"] == pytest.approx(
        {"gb_per_s": 20.0, "of_stream": 0.5}
    )
    assert rows["decode_b1_short_tok_s"]["theirs"]["of_stream"] == pytest.approx(0.25)


def test_the_streaming_read_gives_a_speed_per_read():
    speeds = stream_gb_per_s(packaged_llm_path(), reads=2)
    assert len(speeds) == 2 and all(s > 0 for s in speeds)
