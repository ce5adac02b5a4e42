"""Chunk KV reuse on the packaged SmolLM2: re-rotation, blending against plain prefill as the
reference, tenants, deleted documents, a full pool, and the host and disk tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixrag.engine.chunks.blend import place_reused_kv, read_entry_kv, rerotate_keys
from prefixrag.engine.chunks.reuse_plan import ReuseHit
from prefixrag.engine.chunks.store import ChunkSpan
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.llm_engine import LLMEngine
from prefixrag.engine.model import apply_rope
from prefixrag.engine.model_runner import StepItem
from prefixrag.engine.outputs import GenerationResult
from prefixrag.engine.sampling.params import SamplingParams
from tests.engine.llm_fixtures import make_engine

HEAD = "You are a careful assistant. Answer from the numbered sources.\nSources:\n"
BODIES = {
    "rhine": "The Rhine rises in the Swiss Alps and flows north to the North Sea, passing Basel, "
    "Strasbourg, Cologne and Rotterdam. It is about 1,230 kilometres long.\n",
    "danube": "The Danube rises in the Black Forest and flows east to the Black Sea through ten "
    "countries, more than any other river in the world.\n",
    "loire": "The Loire is the longest river in France, flowing 1,006 kilometres from the Massif "
    "Central to the Atlantic at Saint-Nazaire.\n",
}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def build(engine: LLMEngine, names: list[str], question: str) -> tuple[list[int], list[ChunkSpan]]:
    """Prompt ids with each body after a numbered header, and the bodies' spans."""
    tok = engine.tokenizer
    ids, spans = tok.encode(HEAD), []
    for n, name in enumerate(names, start=1):
        ids += tok.encode(f"[{n}] {name.title()}\n")
        body = tok.encode(BODIES[name])
        spans.append(ChunkSpan(len(ids), len(body), (f"doc:{name}",)))
        ids += body
    return ids + tok.encode(f"Question: {question}\nAnswer:"), spans


def run(
    engine: LLMEngine, ids: list[int], spans: list[ChunkSpan], namespace: str = ""
) -> GenerationResult:
    seq_id = engine.add_request(
        ids, GREEDY, chunk_spans=spans, cache_scope=CacheScope(namespace=namespace)
    )
    while True:
        for event in engine.step():
            if event.seq_id == seq_id and isinstance(event.output, GenerationResult):
                return event.output


FIRST = (["rhine", "danube"], "Which river reaches the North Sea?")
SECOND = (["loire", "danube", "rhine"], "How long is the Rhine?")


@pytest.fixture(scope="module")
def full_recompute(request: pytest.FixtureRequest) -> LLMEngine:
    return make_engine(request, chunk_recompute_fraction=1.0)


@pytest.fixture(scope="module")
def reuse_off(request: pytest.FixtureRequest) -> LLMEngine:
    return make_engine(request, enable_chunk_reuse=False)


def test_rerotated_keys_equal_keys_computed_at_the_new_position(
    full_recompute: LLMEngine,
) -> None:
    cos_sin = full_recompute.runner.model.cos_sin_cache.float()
    half = cos_sin.shape[1] // 2
    raw = torch.randn(40, 3, 2 * half, generator=torch.Generator().manual_seed(0))

    def at(start: int) -> torch.Tensor:
        rows = cos_sin[torch.arange(start, start + raw.shape[0])].unsqueeze(1)
        return apply_rope(raw, rows[..., :half], rows[..., half:])

    # float32 angles (position * frequency) carry ~1e-4 of error at a few thousand positions,
    # in the direct rotation as much as in the composed one
    for old, new in [(7, 300), (300, 7), (0, 1500), (123, 123)]:
        moved = rerotate_keys(at(old), new - old, cos_sin)
        torch.testing.assert_close(moved, at(new), atol=5e-4, rtol=1e-3)
    assert not torch.allclose(rerotate_keys(at(7), 292, cos_sin), at(7), atol=1e-2)


def test_placed_keys_equal_a_prefill_at_the_new_position(full_recompute: LLMEngine) -> None:
    # Layer 0's K/V depend on the token and its position only: a body computed at one place
    # and placed (re-rotated) at another must hold what a prefill there computes, in layer 0.
    runner = full_recompute.runner
    ids1, spans1 = build(full_recompute, *FIRST)
    ids2, spans2 = build(full_recompute, *SECOND)
    bs = runner.block_size
    blocks1 = list(range(0, -(-len(ids1) // bs)))
    blocks2 = list(range(100, 100 + -(-len(ids2) // bs)))
    runner.run([StepItem(ids1, 0, blocks1)])
    rhine1, rhine2 = spans1[0], spans2[2]
    entry_blocks = list(range(60, 60 + -(-rhine1.length // bs)))
    runner.copy_chunk(blocks1, rhine1.start, rhine1.length, entry_blocks)
    hit = ReuseHit(rhine2.start, rhine2.length, tuple(entry_blocks), rhine1.start)
    place_reused_kv(
        runner.kv_pool, [hit], blocks2, first_layer=0, cos_sin_cache=runner.model.cos_sin_cache
    )
    placed_k, placed_v = read_entry_kv(runner.kv_pool, blocks2, len(ids2))
    runner.run([StepItem(ids2, 0, blocks2)])
    fresh_k, fresh_v = read_entry_kv(runner.kv_pool, blocks2, len(ids2))
    body = slice(rhine2.start, rhine2.end)
    # a float32 cache holds them up to float32 rounding; a 16-bit one (the CPU default) rounds
    # the placed keys twice (computed, then re-rotated) and the fresh ones once: a few ulps
    k_tol, v_tol, differ = (
        (1e-4, 1e-5, 1e-3) if runner.kv_dtype == torch.float32 else (2e-2, 0, 5e-2)
    )
    torch.testing.assert_close(placed_k[0, body], fresh_k[0, body], atol=k_tol, rtol=k_tol)
    torch.testing.assert_close(placed_v[0, body], fresh_v[0, body], atol=v_tol, rtol=v_tol)
    # deeper layers saw other context at the new place: they differ (that is why we blend)
    assert not torch.allclose(placed_k[-1, body], fresh_k[-1, body], atol=differ)


def test_blending_at_full_recompute_equals_plain_prefill(full_recompute: LLMEngine) -> None:
    runner = full_recompute.runner
    ids1, spans1 = build(full_recompute, *FIRST)
    ids2, spans2 = build(full_recompute, *SECOND)
    bs = runner.block_size
    blocks1 = list(range(0, -(-len(ids1) // bs)))
    runner.run([StepItem(ids1, 0, blocks1)])
    hits, free = [], 60
    for old, new in [(spans1[0], spans2[2]), (spans1[1], spans2[1])]:
        entry = list(range(free, free + -(-old.length // bs)))
        free += len(entry)
        runner.copy_chunk(blocks1, old.start, old.length, entry)
        hits.append(ReuseHit(new.start, new.length, tuple(entry), old.start))
    n2 = -(-len(ids2) // bs)
    plain = runner.run([StepItem(ids2, 0, list(range(100, 100 + n2)))])
    blended, recomputed = runner.run_blend(
        StepItem(ids2, 0, list(range(150, 150 + n2))), hits, fraction=1.0, select_layer=1
    )
    assert recomputed == sum(h.num_tokens for h in hits)
    torch.testing.assert_close(blended, plain, atol=2e-3, rtol=1e-3)
    assert int(blended.argmax()) == int(plain.argmax())
    # with nothing recomputed, the logits are those of the reused KV: close, not equal
    partial, none_recomputed = runner.run_blend(
        StepItem(ids2, 0, list(range(200, 200 + n2))), hits, fraction=0.0, select_layer=1
    )
    assert none_recomputed == 0
    assert not torch.allclose(partial, plain, atol=2e-3)


def test_engine_full_recompute_gives_the_same_tokens_as_no_reuse(
    full_recompute: LLMEngine, reuse_off: LLMEngine
) -> None:
    first, second = build(full_recompute, *FIRST), build(full_recompute, *SECOND)
    run(full_recompute, *first)
    reused = run(full_recompute, *second)
    run(reuse_off, *first)
    reference = run(reuse_off, *second)
    assert reused.recomputed_tokens == sum(s.length for s in second[1][1:])
    assert reused.token_ids == reference.token_ids
    assert reference.blended_tokens == reference.recomputed_tokens == 0
    assert reuse_off.scheduler.chunks.num_entries == 0


def test_blending_reuses_most_of_a_known_body(request: pytest.FixtureRequest) -> None:
    engine = make_engine(request, chunk_recompute_fraction=0.15)
    first, second = build(engine, *FIRST), build(engine, *SECOND)
    cold = run(engine, *first)
    assert cold.blended_tokens == 0 and engine.scheduler.chunks.num_entries == 2
    warm = run(engine, *second)
    reused = sum(s.length for s in second[1][1:])
    assert warm.blended_tokens + warm.recomputed_tokens == reused
    assert warm.recomputed_tokens == pytest.approx(0.15 * reused, abs=1)
    assert engine.scheduler.chunks.num_entries == 3  # the Loire is new: kept for next time
    stats = engine.cache_stats()
    assert stats["blended_tokens"] == warm.blended_tokens and stats["chunk_hits"] == 2

    # another tenant never reuses (or times) these bodies
    other = run(engine, *second, namespace="tenant-b")
    assert other.blended_tokens == other.recomputed_tokens == 0

    # a deleted document's bodies leave the store, so they cannot be reused any more
    assert engine.drop_chunks("", "doc:rhine") == 1
    again = run(engine, *build(engine, ["rhine", "loire"], "Where does the Loire end?"))
    loire = len(engine.tokenizer.encode(BODIES["loire"]))
    assert again.blended_tokens + again.recomputed_tokens == loire


def test_a_full_pool_degrades_to_plain_prefill(request: pytest.FixtureRequest) -> None:
    # room for the prompts but never for a body of its own: no reuse, and no error
    engine = make_engine(request, num_kv_blocks=9, chunk_host_bytes=0)
    ids, spans = build(engine, *FIRST)
    assert -(-(len(ids) + GREEDY.max_tokens) // 16) == 8  # one block spare, a body needs 3
    results = [run(engine, ids, spans) for _ in range(2)]
    assert results[0].token_ids == results[1].token_ids
    assert engine.scheduler.chunks.inserts == 0


def test_evicted_bodies_come_back_from_host_memory(request: pytest.FixtureRequest) -> None:
    engine = make_engine(request, num_kv_blocks=24, chunk_recompute_fraction=1.0)
    reference = make_engine(request, enable_chunk_reuse=False)
    first, second = build(engine, *FIRST), build(engine, *SECOND)
    run(engine, *first)
    # another tenant's prompt needs the pool: the bodies are evicted to host memory
    run(engine, *build(engine, ["loire", "danube", "rhine"], "Which is longest?"), namespace="b")
    assert engine.chunk_tiers.host.num_entries >= 1
    warm = run(engine, *second)
    assert engine.chunk_tiers.host.hits >= 1 and warm.recomputed_tokens > 0
    run(reference, *first)
    assert warm.token_ids == run(reference, *second).token_ids


def test_disk_tier_serves_bodies_after_a_restart(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    disk = str(tmp_path / "kv")
    engine = make_engine(request, chunk_disk_dir=disk)
    run(engine, *build(engine, *FIRST))
    engine.close()
    restarted = make_engine(request, chunk_disk_dir=disk)
    warm = run(restarted, *build(restarted, *SECOND))
    assert warm.blended_tokens > 0
    assert restarted.cache_stats()["chunk_disk_hits"] == 2
    # a restart with chunk reuse off ignores the tier entirely
    off = make_engine(request, chunk_disk_dir=disk, enable_chunk_reuse=False)
    assert off.chunk_tiers.disk is None
    restarted.close()
