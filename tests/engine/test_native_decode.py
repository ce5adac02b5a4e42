"""The one-call C decode step against the torch model on the same GGUF block weights."""

from __future__ import annotations

import pytest
import torch

from prefixrag.app.core.settings import packaged_llm_path
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.kernels.decode_step import MAX_ROWS

BLOCK = 8


@pytest.fixture(scope="module")
def runners(tmp_path_factory) -> dict[str, ModelRunner]:
    cache_dir = tmp_path_factory.mktemp("native-decode")
    return {
        backend: ModelRunner(
            packaged_llm_path(),
            block_size=BLOCK,
            num_blocks=128,
            cache_dir=cache_dir,
            weight_quant="gguf",
            backend=backend,
        )
        for backend in ("native", "torch")
    }


def _prefill_then_decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list:
    """Prefill each prompt in its own blocks, then decode ``steps`` tokens for all of them
    together (greedy); returns each step's logits [B, vocab]."""
    tables, lens, nxt = [], [], []
    for i, ids in enumerate(prompts):
        table = list(range(i * 16, (i + 1) * 16))
        logits = runner.run([StepItem(ids, 0, table)])
        tables.append(table)
        lens.append(len(ids))
        nxt.append(int(logits[0].argmax()))
    out = []
    for _ in range(steps):
        items = [StepItem([t], n, tb) for t, n, tb in zip(nxt, lens, tables, strict=True)]
        logits = runner.run(items)
        out.append(logits)
        nxt = [int(row.argmax()) for row in logits]
        lens = [n + 1 for n in lens]
    return out


def test_gguf_runner_takes_the_c_step_only_under_the_native_backend(runners):
    assert runners["native"].decode_stack is not None
    assert runners["torch"].decode_stack is None


def test_c_decode_step_matches_the_torch_model(runners):
    tok = runners["native"].tokenizer
    prompts = [
        tok.encode("The Rhine rises in the Swiss Alps and flows"),
        tok.encode("Paged attention stores the KV cache in blocks, so"),
        tok.encode("1, 2, 3, 4, 5,"),
    ]
    native = _prefill_then_decode(runners["native"], prompts, 6)
    torch_path = _prefill_then_decode(runners["torch"], prompts, 6)
    for ours, ref in zip(native, torch_path, strict=True):
        # same weights, same float32 math; only summation order differs
        torch.testing.assert_close(ours, ref, atol=2e-3, rtol=2e-3)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_c_decode_step_is_batch_invariant(runners):
    runner = runners["native"]
    tok = runner.tokenizer
    prompt = tok.encode("A sequence decoded alone or beside others")
    other = tok.encode("gets the same logits, bit for bit, because")
    alone = _prefill_then_decode(runner, [prompt], 3)
    together = _prefill_then_decode(runner, [prompt, other, other[:5]], 3)
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a[0], b[0])


def test_c_decode_step_rejects_a_block_table_too_short(runners):
    runner = runners["native"]
    stack = runner.decode_stack
    x = torch.zeros(1, stack.hidden)
    before = runner.kv_caches[0][0].clone()
    with pytest.raises(ValueError, match="out of range"):
        stack.run(
            x,
            torch.tensor([20]),
            torch.tensor([20]),
            torch.tensor([[0, 1]], dtype=torch.int32),  # 16 slots for 21 tokens
            torch.tensor([21], dtype=torch.int32),
        )
    assert torch.equal(runner.kv_caches[0][0], before)
    with pytest.raises(ValueError, match="rows"):
        stack.run(
            torch.zeros(MAX_ROWS + 1, stack.hidden),
            *(torch.zeros(MAX_ROWS + 1, dtype=torch.int64),) * 2,
            torch.zeros(MAX_ROWS + 1, 1, dtype=torch.int32),
            torch.ones(MAX_ROWS + 1, dtype=torch.int32),
        )
