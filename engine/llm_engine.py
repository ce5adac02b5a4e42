"""The synchronous engine: scheduler, model runner, sampler and detokenizer, step by step."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch

from prefixrag.engine.chunks.store import ChunkSpan
from prefixrag.engine.chunks.tiers import ChunkTiers
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.detokenizer import IncrementalDetokenizer
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.model_runner import ModelRunner, StepItem
from prefixrag.engine.outputs import GenerationDelta, GenerationResult, TokenLogprob
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.sampling.sampler import Sampler, SamplerOutput, SamplingError
from prefixrag.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from prefixrag.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    """Engine-side bookkeeping of one request beyond what the scheduler tracks."""

    request_id: str
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    arrival: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    stopped_on: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class StepFailedError(RuntimeError):
    """A step failed for the sequences ``seq_ids`` (all of the step when the model failed, only
    some when sampling failed for them); those were aborted, the engine goes on. ``events`` is
    what the step produced for the others, which the caller must still deliver."""

    def __init__(
        self, cause: BaseException, seq_ids: list[int], events: list[StepEvent] | None = None
    ) -> None:
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.seq_ids = seq_ids
        self.events = events or []


@dataclass(slots=True)
class StepEvent:
    """What one step produced for one request: a delta, or its final result."""

    seq_id: int
    output: GenerationDelta | GenerationResult


class LLMEngine:
    """Continuous-batching generation over a paged KV cache with radix prefix reuse.

    Not thread-safe: one thread drives it (see AsyncEngine for the concurrent front end).
    """

    def __init__(self, config: EngineConfig, *, runner: ModelRunner | None = None) -> None:
        """``runner``: a prebuilt one (e.g. :meth:`ModelRunner.from_config` for benchmarks);
        then ``config`` only shapes the scheduler, and its model and KV fields are not read."""
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        # the disk tier only where chunk reuse runs at all (it needs the prefix cache)
        reuse = config.enable_chunk_reuse and config.enable_prefix_cache
        self.chunk_tiers = ChunkTiers(
            self.runner,
            host_bytes=config.chunk_host_bytes,
            disk_dir=config.chunk_disk_dir if reuse else None,
            disk_bytes=config.chunk_disk_bytes,
            fingerprint=self.runner.kv_fingerprint(),
        )
        self.scheduler = Scheduler(
            config,
            self.runner.num_blocks,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_model_len=self.runner.max_model_len,
            model=str(self.runner.kv_fingerprint()["model"]),
            chunk_tiers=self.chunk_tiers,
        )
        self.blended_tokens = 0  # reused chunk tokens not recomputed, since start
        self.recomputed_tokens = 0  # reused chunk tokens recomputed by blending, since start
        self.max_model_len = min(self.runner.max_model_len, self.scheduler.max_seq_len)
        if config.cuda_graphs and self.runner.can_capture_graphs:
            self.runner.capture_decode_graphs(config.max_num_seqs)
        self.sampler = Sampler()
        self._requests: dict[int, _Request] = {}
        self._seq_ids = itertools.count()

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    def add_request(
        self,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams,
        *,
        cache_scope: CacheScope = CacheScope(),
        request_id: str | None = None,
        chunk_spans: SequenceOf[ChunkSpan] = (),
    ) -> int:
        """Queue a request; returns its seq id. ValueError if the prompt can never run.

        ``cache_scope`` says which cached blocks the request may reuse and under which
        namespace its own are cached (see :class:`CacheScope`). ``chunk_spans`` name the
        prompt's source bodies, whose KV the chunk store keeps and may supply."""
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the context window of "
                f"{self.max_model_len} tokens"
            )
        if prompt_token_ids and max(prompt_token_ids) >= self.runner.vocab_size:
            raise ValueError("prompt contains token ids outside the vocabulary")
        if params.logit_bias and max(params.logit_bias) >= self.runner.vocab_size:
            last = self.runner.vocab_size - 1
            raise ValueError(f"logit_bias names token ids outside the vocabulary (0..{last})")
        seq_id = next(self._seq_ids)
        seq = Sequence(
            seq_id,
            list(prompt_token_ids),
            params,
            cache_scope=cache_scope,
            chunk_spans=tuple(chunk_spans),
            arrival_time=time.monotonic(),
        )
        self.scheduler.add(seq)
        self.sampler.start(seq_id, prompt_token_ids, params)
        detok = IncrementalDetokenizer(self.tokenizer.decode, params.stop, params.stop_after)
        self._requests[seq_id] = _Request(
            request_id or f"req-{seq_id}",
            seq,
            detok,
            seq.arrival_time,
            logprobs=[] if params.logprobs is not None else None,
        )
        return seq_id

    def abort(self, seq_id: int) -> list[StepEvent]:
        """Cancel a request now, freeing its blocks; returns its last events (none if unknown)."""
        req = self._requests.get(seq_id)
        if req is None:
            return []
        self.scheduler.abort(seq_id)
        return self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pin_prefix(self, token_ids: SequenceOf[int], cache_scope: CacheScope = CacheScope()) -> int:
        """Keep the cached blocks of this (already computed) prefix from eviction; returns the
        number of tokens pinned."""
        return self.scheduler.cache.pin(list(token_ids), cache_scope).num_tokens

    def drop_chunks(self, namespace: str, tag: str) -> int:
        """Forget every cached chunk body of ``namespace`` tagged ``tag`` (a deleted document),
        in every tier; returns how many entries went."""
        return self.scheduler.chunks.drop_tag(namespace, tag) + self.chunk_tiers.drop_tag(
            namespace, tag
        )

    def close(self) -> None:
        """Finish pending disk-tier writes."""
        self.chunk_tiers.close()

    def step(self) -> list[StepEvent]:
        """Run one scheduling step and return what it produced."""
        out = self.scheduler.schedule()
        events: list[StepEvent] = []
        for seq in out.finished:  # ended by the scheduler itself (can never fit)
            if seq.seq_id in self._requests:
                events.extend(
                    self._finish(self._requests[seq.seq_id], seq.finish_reason or "length")
                )
        if not out.seqs:
            return events
        sampled_seqs = [item.seq for item in out.seqs if item.do_sample]
        unsampled: SamplingError | None = None
        try:
            sampled = self._forward(out, sampled_seqs)
        except SamplingError as exc:  # per request: the model ran, only these rows got no token
            unsampled, sampled = exc, SamplerOutput(exc.token_ids, exc.logprobs)
        except Exception as exc:
            # Keep the engine consistent: drop the step, abort what was in it, report it.
            self.scheduler.discard(out)
            seq_ids = [item.seq.seq_id for item in out.seqs]
            for seq_id in seq_ids:
                self.abort(seq_id)
            raise StepFailedError(exc, seq_ids, events) from exc
        try:
            self.chunk_tiers.capture(out.seqs)
        except Exception:  # keeping bodies for later is an optimization: never fail a request
            logger.exception("could not keep this step's source bodies in the chunk store")
        if unsampled is not None:
            # After the capture (their KV is sound), before postprocess, which then skips them.
            for seq_id in unsampled.seq_ids:
                self.abort(seq_id)
        finished = self.scheduler.postprocess(out, sampled.token_ids)
        now = time.monotonic()
        for seq, token_id, logprob in zip(
            sampled_seqs, sampled.token_ids, sampled.logprobs, strict=True
        ):
            req = self._requests.get(seq.seq_id)
            if req is not None:
                events.extend(self._on_token(req, token_id, logprob, now))
        for seq in finished:
            req = self._requests.get(seq.seq_id)
            if req is not None:
                events.extend(self._finish(req, seq.finish_reason or "stop"))
        if unsampled is not None:
            raise StepFailedError(unsampled, unsampled.seq_ids, events) from unsampled
        return events

    def generate(
        self, prompts: SequenceOf[str | SequenceOf[int]], params: SamplingParams
    ) -> list[GenerationResult]:
        """Run prompts to completion, batched together; results in prompt order."""
        seq_ids = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            seq_ids.append(self.add_request(ids, params))
        results: dict[int, GenerationResult] = {}
        while len(results) < len(seq_ids):
            for event in self.step():
                if isinstance(event.output, GenerationResult):
                    results[event.seq_id] = event.output
        return [results[i] for i in seq_ids]

    def cache_stats(self) -> dict[str, int]:
        """Prefix-cache and chunk-store counters and KV block occupancy."""
        cache, pool = self.scheduler.cache, self.scheduler.blocks.block_pool
        chunks = self.scheduler.chunks
        return {
            "chunk_hits": chunks.hits,
            "chunk_misses": chunks.misses,
            "chunk_inserts": chunks.inserts,
            "chunk_evictions": chunks.evictions,
            "chunk_entries": chunks.num_entries,
            "chunk_blocks": chunks.num_blocks,
            "chunk_pool_bytes": chunks.num_blocks
            * self.runner.block_size
            * self.runner.kv_bytes_per_token,
            **self.chunk_tiers.stats(),
            "blended_tokens": self.blended_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "queried_tokens": cache.queried_tokens,
            "hit_tokens": cache.hit_tokens,
            "evicted_blocks": cache.evicted_blocks,
            "blocks_total": self.runner.num_blocks,
            "blocks_free": pool.num_free_blocks,
            "blocks_used": pool.num_used_blocks,
            "blocks_cached": cache.num_cached_blocks,
            "blocks_pinned": cache.num_pinned_blocks,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
        }

    # -- internals ------------------------------------------------------------------------

    def _forward(self, out: SchedulerOutput, sampled_seqs: list[Sequence]) -> SamplerOutput:
        plain = [s for s in out.seqs if s.reuse is None]
        rows: dict[int, torch.Tensor] = {}  # seq id -> its logits row
        sampled_ids = [s.seq_id for s in sampled_seqs]
        logits = None
        if plain:
            items = [StepItem(s.token_ids, s.start_pos, s.block_ids, s.do_sample) for s in plain]
            logits = self.runner.run(items)  # [num_sampled, vocab]
            plain_ids = [s.seq.seq_id for s in plain if s.do_sample]
            if len(plain) < len(out.seqs) or plain_ids != sampled_ids:
                rows.update(zip(plain_ids, logits, strict=True))
                logits = None
        for s in out.seqs:
            if s.reuse is not None:  # a blended prefill runs alone: its rows shrink mid-model
                rows[s.seq.seq_id] = self._blend(s)
        if not sampled_seqs:
            return SamplerOutput([], [])
        if logits is None:  # NOTE: the common step's rows are in order already: no copy
            logits = torch.stack([rows[seq_id] for seq_id in sampled_ids])
        return self.sampler.sample_with_logprobs(
            logits, sampled_ids, [s.sampling_params for s in sampled_seqs]
        )

    def _blend(self, item: ScheduledSeq) -> torch.Tensor:
        assert item.reuse is not None
        step = StepItem(item.token_ids, item.start_pos, item.block_ids, True)
        logits, num_recomputed = self.runner.run_blend(
            step,
            item.reuse.hits,
            fraction=self.config.chunk_recompute_fraction,
            select_layer=self.config.chunk_select_layer,
        )
        num_blended = item.reuse.num_reused_tokens - num_recomputed
        seq = item.seq
        if seq.num_completion_tokens == 0:  # a prompt's first prefill, not a preempted rerun
            seq.num_blended_tokens, seq.num_recomputed_tokens = num_blended, num_recomputed
        self.blended_tokens += num_blended
        self.recomputed_tokens += num_recomputed
        return logits[0]

    def _on_token(
        self, req: _Request, token_id: int, logprob: TokenLogprob | None, now: float
    ) -> list[StepEvent]:
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        req.token_ids.append(token_id)
        seq, params = req.seq, req.seq.sampling_params
        # A stop token id or EOS ends the output without showing up in its text.
        is_stop_token = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.tokenizer.eos_token_ids
        )
        if is_stop_token or req.stopped_on is not None:
            return []
        step = req.detokenizer.add(token_id)
        # logprobs follow the tokens the deltas carry, so the text and its logprobs agree
        logprobs = None
        if req.logprobs is not None and logprob is not None:
            logprobs = [logprob]
            req.logprobs.append(logprob)
        events = [StepEvent(seq.seq_id, GenerationDelta(step.delta, [token_id], logprobs))]
        if step.stopped_on is not None:
            req.stopped_on = step.stopped_on
            if not seq.is_finished:
                self.scheduler.finish(seq.seq_id, "stop")
            events.extend(self._finish(req, "stop"))
        return events

    def _finish(self, req: _Request, reason: str) -> list[StepEvent]:
        """The request's last events: any held-back text, then its result."""
        seq_id = req.seq.seq_id
        self._requests.pop(seq_id, None)
        self.sampler.release(seq_id)
        events = []
        tail = req.detokenizer.flush() if req.stopped_on is None else ""
        if tail:
            events.append(StepEvent(seq_id, GenerationDelta(tail, [])))
        first, last = req.first_token_at, req.last_token_at
        n = len(req.token_ids)
        result = GenerationResult(
            request_id=req.request_id,
            text=req.detokenizer.text,
            token_ids=list(req.token_ids),
            finish_reason=reason,
            prompt_tokens=req.seq.num_prompt_tokens,
            cached_tokens=req.seq.num_cached_tokens,
            blended_tokens=req.seq.num_blended_tokens,
            recomputed_tokens=req.seq.num_recomputed_tokens,
            completion_tokens=n,
            ttft_s=(first - req.arrival) if first is not None else 0.0,
            tpot_s=((last - first) / (n - 1)) if first is not None and last and n > 1 else 0.0,
            stop_reason=req.stopped_on,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
        )
        events.append(StepEvent(seq_id, result))
        return events
