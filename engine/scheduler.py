"""Continuous batching: chunked prefill, longest-prefix-first admission, preemption by recompute,
and the reuse plan of each admitted prompt's cached chunk bodies."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from prefixrag.engine.chunks.reuse_plan import ReuseHit, ReusePlan
from prefixrag.engine.chunks.store import ChunkEntry, ChunkSpan, ChunkStore
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.kv_cache.block_manager import BlockManager
from prefixrag.engine.kv_cache.radix_cache import HashFn, RadixCache, block_key
from prefixrag.engine.sequence import Sequence, SequenceStatus


class ChunkTierHooks(Protocol):
    """The chunk store's slower tiers, as the scheduler meets them (engine/chunks/tiers.py)."""

    def attach(self, store: ChunkStore) -> None:
        """The store the tiers serve: this scheduler's."""

    def spill(self, entry: ChunkEntry) -> None:
        """``entry`` is about to leave the pool (evicted)."""

    def load(self, namespace: str, body: tuple[int, ...], span: ChunkSpan) -> ChunkEntry | None:
        """A body the pool lacks, now in the store from a slower tier, or None."""


@dataclass(slots=True)
class SchedulingPolicy:
    """Knobs of waiting-queue ordering; raises ValueError on invalid values.

    NOTE: waiting requests are ranked by ``cached prefix tokens + aging_tokens_per_step * steps
    waited`` (longest prefix first, with aging). Any request that has waited
    ``max_waiting_steps`` steps or more goes ahead of all others, oldest first, and admission
    stops at the first request that does not fit, so nothing starves. Only the oldest
    ``lpm_window`` waiting requests are ranked, because ranking hashes their prompts; beyond that
    the queue is first come, first served.
    """

    aging_tokens_per_step: int = 16
    max_waiting_steps: int = 256
    lpm_window: int = 64

    def __post_init__(self) -> None:
        for name in ("aging_tokens_per_step", "max_waiting_steps", "lpm_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute ``token_ids`` at positions ``start_pos`` onward.

    ``block_ids`` is the sequence's live block table, covering ``start_pos + len(token_ids)``
    tokens; read it before ``postprocess``. ``do_sample`` is True when this step reaches the end
    of the sequence (decode, or the last prefill chunk) and so must produce one token. ``reuse``
    names cached chunk bodies to place among ``token_ids`` instead of computing them all (then
    ``token_ids`` is the whole rest of the prompt, in one step).

    NOTE: a decoding sequence keeps one entry, which each ``schedule`` updates in place
    (building 64 entries a step was a sixth of the scheduler's time), so read an output, its
    ``token_ids`` list included, before the next ``schedule``.
    """

    seq: Sequence
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    do_sample: bool
    reuse: ReusePlan | None = None
    # a decode entry's stop test, precomputed once (see Scheduler._decode_item): the sequence
    # may have stopped when it holds stop_len tokens or sampled one of stop_ids; the defaults
    # send every sample of other entries to the full test
    stop_len: int = 0
    stop_ids: frozenset[int] = frozenset()

    @property
    def context_len(self) -> int:
        """Tokens with KV once this step ran."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: what to compute, plus sequences preempted or finished while scheduling it."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    num_samples: int = 0  # entries with do_sample: how many tokens ``postprocess`` expects


class Scheduler:
    """Decides, step by step, which tokens of which sequences to compute.

    Each step: one decode token for every running sequence, then prefill chunks for partially
    prefilled ones, then newly admitted requests, all within ``max_num_batched_tokens`` and
    ``max_num_seqs``. When blocks run out the newest running sequence is preempted (its blocks
    released; it waits again and re-matches the cache). Call ``schedule``, run the model, then
    ``postprocess`` with the sampled tokens, strictly alternating. ``max_model_len`` (for example
    the model's own context limit) caps sequence length along with the pool and the config.
    Not thread-safe: one thread drives it.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        policy: SchedulingPolicy | None = None,
        hash_fn: HashFn = block_key,
        model: str = "",
        chunk_tiers: ChunkTierHooks | None = None,
    ) -> None:
        num_blocks = config.num_kv_blocks if num_kv_blocks is None else num_kv_blocks
        if num_blocks is None:
            raise ValueError("the number of KV blocks is needed (num_kv_blocks)")
        self.config = config
        self.policy = policy or SchedulingPolicy()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.blocks = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_cache=config.enable_prefix_cache,
            enable_chunk_reuse=config.enable_chunk_reuse,
            model=model,
            on_chunk_evict=chunk_tiers.spill if chunk_tiers is not None else None,
            hash_fn=hash_fn,
        )
        self.chunk_tiers = chunk_tiers
        if chunk_tiers is not None:
            chunk_tiers.attach(self.chunks)
        self._plans: dict[int, ReusePlan] = {}  # by seq id, from admission to postprocess
        self._decode_items: dict[int, ScheduledSeq] = {}  # by seq id, while it runs
        # the longest a sequence may grow: the pool, config.max_model_len, the model's own limit
        limits = (num_blocks * config.block_size, config.max_model_len, max_model_len)
        self.max_seq_len = min(limit for limit in limits if limit is not None)
        if self.max_seq_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self._waiting: dict[int, Sequence] = {}
        self._running: dict[int, Sequence] = {}
        self._step = 0
        self._num_arrivals = 0
        self._in_flight: SchedulerOutput | None = None
        self.num_preemptions = 0  # since start: how often the pool ran out under load

    @property
    def cache(self) -> RadixCache:
        """The prefix cache (counters, pin/unpin)."""
        return self.blocks.cache

    @property
    def chunks(self) -> ChunkStore:
        """The chunk KV store (counters, drop by tag)."""
        return self.blocks.chunks

    @property
    def num_waiting(self) -> int:
        """Requests waiting (new or preempted)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding blocks."""
        return len(self._running)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._waiting or self._running)

    def get(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id, if any."""
        return self._running.get(seq_id) or self._waiting.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; ValueError if it is not new, its id is taken, or its prompt can
        never fit (longer than the KV pool or ``max_model_len``)."""
        if seq.status is not SequenceStatus.WAITING or seq.block_ids:
            raise ValueError(f"sequence {seq.seq_id} is not a new request")
        if seq.seq_id in self._waiting or seq.seq_id in self._running:
            raise ValueError(f"sequence id {seq.seq_id} is already in use")
        if seq.num_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt of {seq.num_tokens} tokens can never fit: the limit is {self.max_seq_len} "
                f"tokens (KV pool and max_model_len)"
            )
        seq.arrival_order = self._num_arrivals
        self._num_arrivals += 1
        seq.enqueue_step = self._step
        self._waiting[seq.seq_id] = seq

    def abort(self, seq_id: int) -> bool:
        """Finish a request with reason ``"abort"``, releasing its blocks now."""
        return self.finish(seq_id, "abort")

    def finish(self, seq_id: int, reason: str) -> bool:
        """Finish a waiting or running request now (e.g. a stop string was seen), releasing its
        blocks. Returns False if no unfinished request has this id."""
        seq = self.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    # -- scheduling -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. An empty ``seqs`` means there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("postprocess() the previous step before scheduling another")
        self._step += 1
        out = SchedulerOutput()
        budget = self._schedule_decodes(out, self.config.max_num_batched_tokens)
        scheduled: set[int] = set()
        if len(out.seqs) < len(self._running):  # else every running sequence decodes
            scheduled = {item.seq.seq_id for item in out.seqs}
            budget = self._schedule_prefill_chunks(out, budget, scheduled)
        self._admit_waiting(out, budget)
        while not out.seqs and (self._running or self._waiting):
            self._unblock(out)
            budget = self._schedule_prefill_chunks(out, budget, scheduled)
            self._admit_waiting(out, budget)
        self._in_flight = out if out.seqs else None
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        # decode: one token per running sequence that is fully prefilled. This loop runs for
        # every sequence on every step, so it does the least it can per sequence: the entry is
        # the sequence's own, updated in place (see ScheduledSeq), and only a sequence that
        # needs a new block leaves the loop, for _grow_for_decode.
        block_size = self.config.block_size
        running = SequenceStatus.RUNNING
        items, append = self._decode_items, out.seqs.append
        for seq in list(self._running.values()):
            token_ids = seq.token_ids
            num_tokens = len(token_ids)
            if seq.status is not running or num_tokens - seq.num_computed_tokens != 1:
                continue
            if num_tokens > len(seq.block_ids) * block_size and not self._grow_for_decode(
                out, seq, num_tokens
            ):
                continue
            item = items.get(seq.seq_id)
            if item is None:
                item = items[seq.seq_id] = self._decode_item(seq)
            item.token_ids[0] = token_ids[-1]
            item.start_pos = num_tokens - 1
            item.block_ids = seq.block_ids
            append(item)
        num_decodes = len(out.seqs)
        out.num_batched_tokens += num_decodes
        out.num_samples += num_decodes
        return budget - num_decodes

    def _decode_item(self, seq: Sequence) -> ScheduledSeq:
        # what postprocess's stop test needs, folded into one length and one set: a sequence
        # may stop once it holds max_tokens completion tokens or max_seq_len tokens in all, or
        # on a stop token id, or on EOS unless ignore_eos (_stop_reason has the last word)
        params = seq.sampling_params
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        stop_len = min(seq.num_prompt_tokens + params.max_tokens, self.max_seq_len)
        return ScheduledSeq(seq, [0], 0, seq.block_ids, True, None, stop_len, stop_ids)

    def _grow_for_decode(self, out: SchedulerOutput, seq: Sequence, num_tokens: int) -> bool:
        # the decode token of ``seq`` starts a new block: preempt the newest sequence not yet
        # scheduled until one can be had. False when ``seq`` itself was preempted or finished.
        while not self.blocks.try_grow(seq, num_tokens):
            scheduled = {item.seq.seq_id for item in out.seqs}
            victim = self._newest_unscheduled(scheduled)
            if victim is seq and not scheduled and self.num_running == 1:
                # alone and still short: pinned blocks fill the pool
                self._finish(seq, "length")
                out.finished.append(seq)
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _schedule_prefill_chunks(
        self, out: SchedulerOutput, budget: int, scheduled: set[int]
    ) -> int:
        # prefill: continue partially prefilled sequences, oldest first, as far as blocks allow
        for seq in self._running.values():
            if budget == 0:
                break
            if seq.seq_id in scheduled:
                continue
            n = min(seq.num_uncomputed_tokens, budget, self.blocks.max_tokens_to_compute(seq))
            if n > 0:
                self._add(out, seq, n, scheduled)
                budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        max_num_seqs = self.config.max_num_seqs
        if budget == 0 or not self._waiting or self.num_running >= max_num_seqs:
            return
        for seq in self._rank_waiting():
            if budget == 0 or self.num_running >= max_num_seqs:
                return
            num_cached = self.blocks.match(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            # blending needs the whole rest of the prompt in one step
            plan = self._plan_reuse(seq, num_cached) if n == seq.num_uncomputed_tokens else None
            if not self.blocks.can_grow(seq, num_cached + n):
                self._release_plan(plan)
                self.blocks.release(seq)
                return
            self.cache.record_query(seq.num_tokens, num_cached)
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            del self._waiting[seq.seq_id]
            self._running[seq.seq_id] = seq
            if plan is not None:
                self._plans[seq.seq_id] = plan
            self._add(out, seq, n, None, plan)
            budget -= n

    def _plan_reuse(self, seq: Sequence, num_cached: int) -> ReusePlan | None:
        # The chunk bodies after the exact prefix that a tier holds, each held until the step
        # ran. A body that ends the prompt is left to compute: the last token needs logits.
        store = self.blocks.chunks
        if not store.enabled or not seq.chunk_spans:
            return None
        plan = ReusePlan()
        namespace = seq.cache_scope.namespace
        for span in seq.chunk_spans:
            if span.start < num_cached or span.end >= seq.num_tokens:
                continue
            body = tuple(seq.token_ids[span.start : span.end])
            entry = store.lookup(namespace, body)
            if entry is None and self.chunk_tiers is not None:
                entry = self.chunk_tiers.load(namespace, body, span)
            if entry is None:
                continue
            store.acquire(entry)
            plan.entries.append(entry)
            hit = ReuseHit(span.start, span.length, tuple(entry.block_ids), entry.base_pos)
            plan.hits.append(hit)
        return plan if plan.hits else None

    def _release_plan(self, plan: ReusePlan | None) -> None:
        for entry in plan.entries if plan is not None else ():
            self.blocks.chunks.release(entry)

    def _drop_plan(self, seq: Sequence) -> None:
        self._release_plan(self._plans.pop(seq.seq_id, None))

    def _rank_waiting(self) -> list[Sequence]:
        step, policy = self._step, self.policy

        def rank(seq: Sequence) -> tuple[int, int, int]:
            waited = step - seq.enqueue_step
            if waited >= policy.max_waiting_steps:
                return (0, 0, seq.arrival_order)
            score = self.blocks.prefix_len(seq) + policy.aging_tokens_per_step * waited
            return (1, -score, seq.arrival_order)

        window = list(islice(self._waiting.values(), policy.lpm_window))
        return sorted(window, key=rank)

    def _unblock(self, out: SchedulerOutput) -> None:
        # nothing fits although work is pending: free blocks, or drop what can never fit
        if self.num_running > 1:
            self._preempt(next(reversed(self._running.values())), out)
            return
        stuck = next(iter(self._running.values())) if self._running else self._rank_waiting()[0]
        # NOTE: only pinned blocks can keep a lone request from fitting; it ends as "length"
        self._finish(stuck, "length")
        out.finished.append(stuck)

    def _add(
        self,
        out: SchedulerOutput,
        seq: Sequence,
        n: int,
        scheduled: set[int] | None,
        reuse: ReusePlan | None = None,
    ) -> None:
        start = seq.num_computed_tokens
        if start + n > len(seq.block_ids) * self.config.block_size:
            self.blocks.grow(seq, start + n)
        token_ids = seq.token_ids[start : start + n]
        do_sample = start + n == seq.num_tokens
        out.seqs.append(ScheduledSeq(seq, token_ids, start, seq.block_ids, do_sample, reuse))
        out.num_batched_tokens += n
        out.num_samples += do_sample
        if scheduled is not None:
            scheduled.add(seq.seq_id)

    def _newest_unscheduled(self, scheduled: set[int]) -> Sequence:
        for seq in reversed(self._running.values()):
            if seq.seq_id not in scheduled:
                return seq
        raise RuntimeError("no running sequence left to preempt")

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._drop_plan(seq)
        self._decode_items.pop(seq.seq_id, None)
        self.blocks.release(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        del self._running[seq.seq_id]
        # preempted requests go back to the front: they are older than anything waiting
        self._waiting = {seq.seq_id: seq, **self._waiting}
        out.preempted.append(seq)

    def discard(self, out: SchedulerOutput) -> None:
        """Forget the latest step because the model never finished it: no KV progress is
        recorded, so its tokens are computed again when their sequences are next scheduled."""
        if out is not self._in_flight:
            raise ValueError("discard() takes the output of the latest schedule()")
        self._in_flight = None
        for item in out.seqs:
            self._drop_plan(item.seq)

    # -- after the model ran ----------------------------------------------------------------

    def postprocess(
        self, out: SchedulerOutput, sampled_token_ids: SequenceOf[int]
    ) -> list[Sequence]:
        """Record that ``out`` ran: advance KV progress, cache newly full blocks, append the
        sampled tokens (one per ``do_sample`` entry, in order) and return the sequences that
        finished (max_tokens, max length, a stop token id, or EOS unless ``ignore_eos``)."""
        if not out.seqs and not sampled_token_ids:
            return []
        if out is not self._in_flight:
            raise ValueError("postprocess() takes the output of the latest schedule()")
        if len(sampled_token_ids) != out.num_samples:
            raise ValueError(
                f"expected {out.num_samples} sampled tokens, got {len(sampled_token_ids)}"
            )
        self._in_flight = None
        finished: list[Sequence] = []
        block_size = self.config.block_size
        running = SequenceStatus.RUNNING
        has_plans = bool(self._plans)
        if not has_plans and out.num_batched_tokens == out.num_samples == len(out.seqs):
            # one token an entry, each sampled: a pure decode step (or 1-token prefill ends)
            for item, token_id in zip(out.seqs, sampled_token_ids, strict=True):
                seq = item.seq
                if seq.status is not running:
                    continue  # finished or aborted while the step ran
                computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
                if computed % block_size == 0:  # the token filled a block
                    self.blocks.cache_full_blocks(seq)
                token_ids = seq.token_ids
                token_ids.append(token_id)
                if len(token_ids) >= item.stop_len or token_id in item.stop_ids:
                    reason = self._stop_reason(seq, token_id)
                    if reason is not None:
                        self._finish(seq, reason)
                        finished.append(seq)
            return finished
        sampled = iter(sampled_token_ids)
        eos_ids, max_seq_len = self.eos_token_ids, self.max_seq_len
        # NOTE: this loop runs for every sequence on every step: the stop test is inlined (a
        # call per sequence is a measurable share of a decode step) and only names the reason
        # through _stop_reason when some condition holds.
        # a decode-only step samples every entry: pair them without a per-entry branch
        pairs = (
            zip(out.seqs, sampled_token_ids, strict=True)
            if out.num_samples == len(out.seqs)
            else ((item, next(sampled) if item.do_sample else None) for item in out.seqs)
        )
        for item, token_id in pairs:
            seq = item.seq
            if has_plans:
                self._drop_plan(seq)
            if seq.status is not running:
                continue  # finished or aborted while the step ran
            n = len(item.token_ids)
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            # a decode step fills a block only on its last slot: skip the tree otherwise
            if n > 1 or computed % block_size == 0:
                self.blocks.cache_full_blocks(seq)
            if token_id is None:
                continue
            token_ids = seq.token_ids
            token_ids.append(token_id)
            params = seq.sampling_params
            num_tokens = len(token_ids)
            if (
                num_tokens - seq.num_prompt_tokens >= params.max_tokens
                or num_tokens >= max_seq_len
                or token_id in eos_ids
                or token_id in params.stop_token_ids
            ):
                reason = self._stop_reason(seq, token_id)
                if reason is not None:
                    self._finish(seq, reason)
                    finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.sampling_params
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        num_tokens = len(seq.token_ids)
        if (
            num_tokens - seq.num_prompt_tokens >= params.max_tokens
            or num_tokens >= self.max_seq_len
        ):
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            del self._running[seq.seq_id]
        else:
            self._waiting.pop(seq.seq_id, None)
        self._drop_plan(seq)
        self._decode_items.pop(seq.seq_id, None)
        self.blocks.forget(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
