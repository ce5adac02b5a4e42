"""Scheduler bookkeeping, driven by a simulated model that keeps real (fake) KV in the blocks.

SimModel writes (token, position, namespace) into the slots each step computes and produces the
next token from what it reads back through the block table. If the scheduler or the cache ever
handed a sequence a wrong, stale or evicted block, that read would differ from the sequence's
own tokens, and its output from the reference made by generating each request alone.
"""

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrag.engine.config import EngineConfig
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.scheduler import Scheduler, SchedulerOutput, SchedulingPolicy
from prefixrag.engine.sequence import Sequence, SequenceStatus

EOS = 0
VOCAB = 29


def next_token(context: list[int]) -> int:
    acc = len(context)
    for t in context:
        acc = (acc * 31 + t) % 1_000_003
    return acc % VOCAB


def reference_output(prompt: list[int], params: SamplingParams, max_len: int) -> list[int]:
    """Generate one request alone, without any cache or batching."""
    tokens = list(prompt)
    while True:
        token = next_token(tokens)
        tokens.append(token)
        done = len(tokens) - len(prompt) >= params.max_tokens or len(tokens) >= max_len
        if token in params.stop_token_ids or (token == EOS and not params.ignore_eos) or done:
            return tokens[len(prompt) :]


@dataclass
class SimModel:
    block_size: int
    slots: dict[tuple[int, int], tuple[int, int, str]] = field(default_factory=dict)
    next_pos: dict[int, int] = field(default_factory=dict)
    computed: dict[int, list[int]] = field(default_factory=dict)  # positions per admission
    contexts: dict[int, list[list[int]]] = field(default_factory=dict)

    def run(self, out: SchedulerOutput) -> list[int]:
        for seq in out.preempted:
            self.next_pos.pop(seq.seq_id, None)
        samples = []
        bs = self.block_size
        for item in out.seqs:
            seq = item.seq
            if seq.seq_id not in self.next_pos:  # (re)admitted: starts after its cached prefix
                assert item.start_pos % bs == 0 and item.start_pos < seq.num_tokens
                self.computed[seq.seq_id] = []
            else:
                assert item.start_pos == self.next_pos[seq.seq_id]  # no gap, no repeat
            assert item.token_ids, "a step must compute at least one token of each sequence"
            assert len(item.block_ids) * bs >= item.context_len
            for pos in range(item.start_pos, item.context_len):
                token = item.token_ids[pos - item.start_pos]
                ns = seq.cache_scope.namespace
                self.slots[(item.block_ids[pos // bs], pos % bs)] = (token, pos, ns)
                self.computed[seq.seq_id].append(pos)
            self.next_pos[seq.seq_id] = item.context_len
            read = [self.slots[(item.block_ids[p // bs], p % bs)] for p in range(item.context_len)]
            ns = seq.cache_scope.namespace
            assert read == [(t, p, ns) for p, t in enumerate(seq.token_ids[: len(read)])]
            assert item.do_sample == (item.context_len == seq.num_tokens)
            if item.do_sample:
                context = [t for t, _, _ in read]
                self.contexts.setdefault(seq.seq_id, []).append(context)
                samples.append(next_token(context))
        return samples


def make_scheduler(
    num_blocks: int = 64,
    *,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    cache: bool = True,
    policy: SchedulingPolicy | None = None,
) -> Scheduler:
    config = EngineConfig(
        model="sim",
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_cache=cache,
    )
    return Scheduler(config, num_blocks, eos_token_ids=[EOS], policy=policy)


def run_to_end(sched: Scheduler, model: SimModel, max_steps: int = 10_000) -> int:
    config = sched.config
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_batched_tokens == sum(len(i.token_ids) for i in out.seqs)
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len({i.seq.seq_id for i in out.seqs}) == len(out.seqs)
        assert sched.num_running <= config.max_num_seqs
        sched.postprocess(out, model.run(out))
        assert_blocks_partition(sched)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def assert_blocks_partition(sched: Scheduler) -> None:
    pool, cache = sched.blocks.block_pool, sched.cache
    tree = [n.block_id for n in cache.iter_nodes()]
    private = []
    for seq in (sched.get(i) for i in list(sched._running)):
        num_tree_blocks = sched.blocks.num_tree_blocks(seq)
        private.extend(seq.block_ids[num_tree_blocks:])
        assert set(seq.block_ids[:num_tree_blocks]) <= set(tree)
    owned = tree + private
    assert len(set(owned)) == len(owned)
    assert {b for b in range(pool.num_blocks) if pool.is_allocated(b)} == set(owned)


def assert_all_blocks_returned(sched: Scheduler) -> None:
    cache, pool = sched.cache, sched.blocks.block_pool
    assert sched.blocks.num_tracked_seqs == 0  # finished sequences leave nothing behind
    assert cache.num_evictable_blocks == cache.num_cached_blocks  # nothing still locked
    assert pool.num_used_blocks == cache.num_cached_blocks
    cache.evict(pool.num_blocks)
    assert pool.num_free_blocks == pool.num_blocks


def workload(seed: int, num: int, prompt_len: int) -> list[tuple[list[int], SamplingParams]]:
    shared = [(seed * 7 + i) % (VOCAB - 1) + 1 for i in range(prompt_len)]
    requests = []
    for i in range(num):
        tail = [(seed + i * 5 + j) % (VOCAB - 1) + 1 for j in range(1 + (i * 3) % 7)]
        prompt = shared[: prompt_len - (i % 3) * 2] + tail
        requests.append((prompt, SamplingParams(max_tokens=1 + (i * 5) % 11, temperature=0)))
    return requests


def run_workload(
    sched: Scheduler, requests, namespaces=("",), model: SimModel | None = None
) -> tuple[list[Sequence], SimModel]:
    model = model or SimModel(sched.config.block_size)
    seqs = [
        Sequence(i, prompt, params, cache_scope=CacheScope(namespaces[i % len(namespaces)]))
        for i, (prompt, params) in enumerate(requests)
    ]
    for seq in seqs:
        sched.add(seq)
    run_to_end(sched, model)
    return seqs, model


@pytest.mark.parametrize("cache", [True, False])
def test_outputs_match_reference_and_blocks_come_back(cache: bool) -> None:
    sched = make_scheduler(cache=cache)
    requests = workload(seed=3, num=12, prompt_len=30)
    seqs, _ = run_workload(sched, requests, namespaces=("a", "b"))
    for seq, (prompt, params) in zip(seqs, requests, strict=True):
        assert seq.status is SequenceStatus.FINISHED
        assert seq.completion_token_ids == reference_output(prompt, params, sched.max_seq_len)
    assert (sched.cache.hit_tokens > 0) == cache
    assert_all_blocks_returned(sched)


def test_cache_on_and_off_compute_the_same_contexts() -> None:
    requests = workload(seed=5, num=10, prompt_len=24)
    runs = []
    for cache in (True, False):
        sched = make_scheduler(num_blocks=40, cache=cache)
        seqs, model = run_workload(sched, requests)
        runs.append((model.contexts, [s.completion_token_ids for s in seqs], sched))
    (on_ctx, on_out, on), (off_ctx, off_out, off) = runs
    assert on_ctx == off_ctx and on_out == off_out
    assert on.cache.hit_tokens > 0 and off.cache.hit_tokens == 0
    assert off.cache.num_cached_blocks == 0 and off.blocks.block_pool.num_used_blocks == 0


def test_chunked_prefill_covers_the_prompt_once() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8, cache=False)
    seq = Sequence(0, list(range(1, 30)), SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(seq)
    model = SimModel(4)
    chunks = []
    while sched.has_unfinished():
        out = sched.schedule()
        chunks.append([(i.start_pos, len(i.token_ids), i.do_sample) for i in out.seqs])
        sched.postprocess(out, model.run(out))
    assert chunks[:4] == [[(0, 8, False)], [(8, 8, False)], [(16, 8, False)], [(24, 5, True)]]
    assert model.computed[0] == list(range(31))  # prompt once, then the two fed-back tokens


def test_tiny_pool_preempts_and_still_finishes_everything() -> None:
    sched = make_scheduler(num_blocks=10, max_num_seqs=6, max_num_batched_tokens=16)
    requests = [
        (list(range(1 + i, 15 + i)), SamplingParams(max_tokens=12, ignore_eos=True))
        for i in range(6)
    ]
    seqs, _ = run_workload(sched, requests)
    assert sum(s.num_preemptions for s in seqs) > 0
    for seq, (prompt, params) in zip(seqs, requests, strict=True):
        assert seq.completion_token_ids == reference_output(prompt, params, sched.max_seq_len)
    assert_all_blocks_returned(sched)


def test_longest_cached_prefix_goes_first() -> None:
    sched = make_scheduler(max_num_seqs=1)
    system = list(range(1, 25))
    run_workload(sched, [([*system, 1], SamplingParams(max_tokens=1))])
    cold = Sequence(10, [7] * 20, SamplingParams(max_tokens=1))
    warm = Sequence(11, [*system, 2, 3], SamplingParams(max_tokens=1))
    sched.add(cold)
    sched.add(warm)
    out = sched.schedule()
    assert [i.seq for i in out.seqs] == [warm]
    assert warm.num_cached_tokens == 24 and out.seqs[0].start_pos == 24


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    sched = make_scheduler()
    prompt = list(range(1, 17))  # four full blocks
    requests = [(prompt, SamplingParams(max_tokens=2, ignore_eos=True))] * 2
    seqs, model = run_workload(sched, requests[:1])
    second = Sequence(7, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(second)
    run_to_end(sched, model)
    assert second.num_cached_tokens == 12 and model.computed[7] == [12, 13, 14, 15, 16]
    assert second.completion_token_ids == seqs[0].completion_token_ids


def test_aging_lets_a_cold_request_through() -> None:
    policy = SchedulingPolicy(aging_tokens_per_step=1, max_waiting_steps=12)
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    system = list(range(1, 41))
    _, model = run_workload(sched, [([*system, 1], SamplingParams(max_tokens=1))])
    cold = Sequence(10_000, [9] * 8, SamplingParams(max_tokens=1))
    sched.add(cold)
    next_id, num_steps = 100, 0
    while not cold.is_finished and num_steps < 40:
        for _ in range(2):  # hot requests keep arriving with a long cached prefix
            sched.add(Sequence(next_id, [*system, next_id % 7 + 1], SamplingParams(max_tokens=1)))
            next_id += 1
        out = sched.schedule()
        sched.postprocess(out, model.run(out))
        num_steps += 1
    assert cold.is_finished and num_steps <= policy.max_waiting_steps + 1
    assert num_steps > 2  # the hot requests did go first for a while


def test_abort_returns_every_block() -> None:
    sched = make_scheduler(num_blocks=30, max_num_seqs=2, max_num_batched_tokens=8)
    model = SimModel(4)
    seqs = [Sequence(i, list(range(1, 20 + i)), SamplingParams(max_tokens=50)) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(3):
        out = sched.schedule()
        sched.postprocess(out, model.run(out))
    out = sched.schedule()
    running = [s for s in seqs if s.status is SequenceStatus.RUNNING]
    assert running and any(s.status is SequenceStatus.WAITING for s in seqs)
    assert sched.abort(running[0].seq_id)  # aborted while its step is in flight
    sched.postprocess(out, model.run(out))
    assert running[0].completion_token_ids == [] or running[0].finish_reason == "abort"
    for seq in seqs:
        sched.abort(seq.seq_id)
    assert not sched.abort(seqs[0].seq_id)
    assert all(s.finish_reason == "abort" for s in seqs) and not sched.has_unfinished()
    assert_all_blocks_returned(sched)


def test_stop_conditions_and_finish() -> None:
    sched = make_scheduler()
    prompt = [3, 4, 5]
    first = next_token(prompt)
    by_eos = Sequence(0, prompt, SamplingParams(max_tokens=9))
    by_stop_id = Sequence(1, prompt, SamplingParams(max_tokens=9, stop_token_ids=[first]))
    ignoring = Sequence(2, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    for seq in (by_eos, by_stop_id, ignoring):
        sched.add(seq)
    out = sched.schedule()
    finished = sched.postprocess(out, [EOS, first, EOS])
    assert [(s.seq_id, s.finish_reason) for s in finished] == [(0, "stop"), (1, "stop")]
    assert sched.finish(2, "stop") and ignoring.finish_reason == "stop"
    assert not sched.finish(2, "stop")


def test_add_rejects_what_can_never_fit() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError):
        sched.add(Sequence(0, list(range(1, 18))))  # 17 tokens > 4 blocks of 4
    sched.add(Sequence(1, list(range(1, 17))))
    with pytest.raises(ValueError):
        sched.add(Sequence(1, [1]))  # id in use
    config = EngineConfig(model="sim", max_model_len=8, num_kv_blocks=64)
    with pytest.raises(ValueError):
        Scheduler(config).add(Sequence(0, list(range(1, 10))))
    capped = Scheduler(EngineConfig(model="sim", num_kv_blocks=64), max_model_len=12)
    assert capped.max_seq_len == 12
    long_one = Sequence(0, list(range(1, 11)), SamplingParams(max_tokens=50, ignore_eos=True))
    capped.add(long_one)
    run_to_end(capped, SimModel(16))
    assert (long_one.num_tokens, long_one.finish_reason) == (12, "length")


def test_postprocess_checks_its_input() -> None:
    sched = make_scheduler()
    sched.add(Sequence(0, [1, 2, 3]))
    out = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()
    with pytest.raises(ValueError):
        sched.postprocess(out, [])
    sched.postprocess(out, [5])
    with pytest.raises(ValueError):
        sched.postprocess(out, [5])


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 1000),
    num=st.integers(1, 10),
    prompt_len=st.integers(1, 30),
    num_blocks=st.integers(9, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 6),
    extra_budget=st.integers(0, 20),
    cache=st.booleans(),
)
def test_random_workloads_match_reference(
    seed, num, prompt_len, num_blocks, block_size, max_num_seqs, extra_budget, cache
) -> None:
    num_blocks = max(num_blocks, -(-(prompt_len + 7) // block_size))
    sched = make_scheduler(
        num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + extra_budget,
        cache=cache,
    )
    requests = workload(seed, num, prompt_len)
    seqs, model = run_workload(sched, requests, namespaces=("x", "y", "x"))
    for seq, (prompt, params) in zip(seqs, requests, strict=True):
        assert seq.completion_token_ids == reference_output(prompt, params, sched.max_seq_len)
        computed = model.computed[seq.seq_id]  # the last admission's positions, each once
        assert computed == list(range(computed[0], seq.num_tokens - 1))
    assert_all_blocks_returned(sched)


def test_pinned_blocks_that_leave_no_room_end_a_request_as_length() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    system = list(range(1, 14))
    _, model = run_workload(sched, [(system, SamplingParams(max_tokens=1))])
    assert sched.cache.pin(system).num_tokens == 12  # three of the four blocks
    seq = Sequence(5, [20] * 9, SamplingParams(max_tokens=4))  # needs three blocks
    sched.add(seq)
    out = sched.schedule()
    assert out.seqs == [] and out.finished == [seq] and seq.finish_reason == "length"
    sharer = Sequence(6, [*system, 21], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(sharer)  # reuses the pinned prefix, so it fits
    run_to_end(sched, model)
    assert sharer.finish_reason == "length" and sharer.num_completion_tokens == 2
    assert sharer.num_cached_tokens == 12


def test_a_lone_decode_left_no_block_by_pinned_ones_ends_as_length() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    system = list(range(1, 10))
    _, model = run_workload(sched, [(system, SamplingParams(max_tokens=1))])
    assert sched.cache.pin(system).num_tokens == 8  # two of the four blocks
    seq = Sequence(5, [20] * 5, SamplingParams(max_tokens=10, ignore_eos=True))
    sched.add(seq)
    run_to_end(sched, model)
    # its ninth token would need a third block, the pool's fifth: it ends there, not preempted
    assert seq.finish_reason == "length" and seq.num_completion_tokens == 4
    assert seq.num_preemptions == 0
    assert seq.block_ids == [] and sched.blocks.num_tracked_seqs == 0


def test_preempted_requests_wait_again_and_keep_their_usage() -> None:
    sched = make_scheduler(num_blocks=8, max_num_seqs=2, max_num_batched_tokens=16)
    model = SimModel(4)
    seqs = [
        Sequence(i, list(range(1 + i, 13 + i)), SamplingParams(max_tokens=14, ignore_eos=True))
        for i in range(2)
    ]
    for seq in seqs:
        sched.add(seq)
    preempted = []
    while sched.has_unfinished():
        out = sched.schedule()
        for seq in out.preempted:
            assert seq.status is SequenceStatus.PREEMPTED and seq.block_ids == []
            preempted.append(seq.seq_id)
        sched.postprocess(out, model.run(out))
    assert preempted and preempted[0] == 1  # the newest goes first
    assert all(s.num_cached_tokens == 0 for s in seqs)  # usage reports the first admission


def test_scheduling_policy_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        SchedulingPolicy(max_waiting_steps=0)
    with pytest.raises(ValueError):
        SchedulingPolicy(lpm_window=True)
    with pytest.raises(ValueError):
        Scheduler(EngineConfig(model="sim"))  # no pool size anywhere
