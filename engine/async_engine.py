"""The concurrent front end: one thread steps the engine, many asyncio callers stream from it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as SequenceOf
from typing import Any

from prefixrag.engine.chunks.store import ChunkSpan
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.llm_engine import LLMEngine, StepEvent, StepFailedError
from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

Deliver = Callable[[GenerationDelta | GenerationResult | BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can run."""


class AsyncEngine:
    """Runs an LLMEngine on its own thread; ``generate`` streams one request's output.

    Every change to the engine (add, abort, pin) is a command executed by the engine thread
    between steps, so the scheduler and the KV cache are only ever touched by that thread.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._deliver: dict[int, Deliver] = {}
        # the tree as the last step left it, for peeks from other threads (see cached_prefix_len)
        self._cached_keys = engine.scheduler.cache.cached_keys()
        self._thread = threading.Thread(target=self._loop, name="prefixrag-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.num_kv_blocks

    @property
    def memory_plan(self) -> dict[str, int] | None:
        """The runner's memory plan in bytes (set once at start: safe from any thread)."""
        plan = getattr(self.engine.runner, "memory_plan", None)
        return plan.as_dict() if plan is not None else None

    async def generate(
        self,
        prompt: str | SequenceOf[int],
        params: SamplingParams,
        *,
        cache_scope: CacheScope = CacheScope(),
        request_id: str | None = None,
        chunk_spans: SequenceOf[ChunkSpan] = (),
    ) -> AsyncIterator[GenerationDelta | GenerationResult]:
        """Yield text deltas as tokens are decoded, then one GenerationResult.

        Closing the iterator early (a client disconnect) aborts the request and frees its
        blocks. Raises ValueError for a prompt that can never run. ``cache_scope`` scopes the
        prefix cache and ``chunk_spans`` name the prompt's source bodies (see
        LLMEngine.add_request).
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Any] = asyncio.Queue()

        def deliver(item: GenerationDelta | GenerationResult | BaseException) -> None:
            _post(loop, inbox.put_nowait, item)

        seq_id_box: list[int] = []
        spans = tuple(chunk_spans)
        self._submit(
            lambda: self._add(ids, params, cache_scope, spans, request_id, deliver, seq_id_box)
        )
        done = False
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
                if isinstance(item, GenerationResult):
                    done = True
                    return
        finally:
            if not done:
                self._submit(lambda: self._abort(seq_id_box))

    async def pin_prefix(
        self, token_ids: SequenceOf[int], cache_scope: CacheScope = CacheScope()
    ) -> int:
        """Compute a prefix (if not cached yet) and pin it so it is never evicted; returns the
        number of pinned tokens (whole blocks only)."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        async for _ in self.generate(list(token_ids), params, cache_scope=cache_scope):
            pass
        return await self.call(lambda engine: engine.pin_prefix(token_ids, cache_scope))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                value = fn(self.engine)
            except BaseException as exc:  # handed to the caller
                _post(loop, _set_exception, future, exc)
            else:
                _post(loop, _set_result, future, value)

        self._submit(run)
        return await future

    def cached_prefix_len(
        self, token_ids: SequenceOf[int], cache_scope: CacheScope = CacheScope()
    ) -> int:
        """How many leading tokens of ``token_ids`` the prefix cache held after the last step.

        Safe from any thread by design: it reads the immutable snapshot of the tree's keys that
        the engine thread publishes between steps (one reference, swapped whole), never the live
        tree. No recency, no counters; at worst the answer is a step old.
        """
        return self._cached_keys.prefix_len(list(token_ids), cache_scope)

    async def drop_chunks(self, namespace: str, tag: str) -> int:
        """Forget the cached chunk bodies of ``namespace`` tagged ``tag`` (a deleted document)."""
        return await self.call(lambda engine: engine.drop_chunks(namespace, tag))

    def stats(self) -> dict[str, int]:
        """Prefix-cache counters and block occupancy (a racy but consistent-enough snapshot)."""
        return self.engine.cache_stats()

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs (a health probe: once False, no request can run)."""
        return self._thread.is_alive() and not self._stopped.is_set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()

    # -- engine thread --------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        if self._stopped.is_set():
            raise EngineDeadError("the engine has stopped")
        self._commands.put(command)
        self._wake.set()

    def _add(
        self,
        ids: list[int],
        params: SamplingParams,
        cache_scope: CacheScope,
        chunk_spans: tuple[ChunkSpan, ...],
        request_id: str | None,
        deliver: Deliver,
        seq_id_box: list[int],
    ) -> None:
        try:
            seq_id = self.engine.add_request(
                ids,
                params,
                cache_scope=cache_scope,
                request_id=request_id,
                chunk_spans=chunk_spans,
            )
        except ValueError as exc:
            deliver(exc)
            return
        seq_id_box.append(seq_id)
        self._deliver[seq_id] = deliver

    def _abort(self, seq_id_box: list[int]) -> None:
        if seq_id_box:
            self._dispatch(self.engine.abort(seq_id_box[0]))

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._run_commands()
            self._cached_keys = self.engine.scheduler.cache.cached_keys()
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self._dispatch(self.engine.step())
            except StepFailedError as exc:  # those requests fail; the others keep running
                logger.exception("engine step failed; its requests were aborted")
                self._dispatch(exc.events)  # what the step still produced for the others
                self._fail(exc.seq_ids, exc)
            except Exception as exc:  # the engine's own state is suspect: fail everything
                logger.exception("engine step failed outside the model; aborting all requests")
                self._fail_all(exc)
        self._fail_all(EngineDeadError("the engine has stopped"))

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # one bad command must not stop the engine thread
                logger.exception("engine command failed")

    def _dispatch(self, events: list[StepEvent]) -> None:
        for event in events:
            deliver = self._deliver.get(event.seq_id)
            if deliver is None:
                continue
            deliver(event.output)
            if isinstance(event.output, GenerationResult):
                del self._deliver[event.seq_id]

    def _fail(self, seq_ids: list[int], exc: BaseException) -> None:
        for seq_id in seq_ids:
            deliver = self._deliver.pop(seq_id, None)
            if deliver is not None:
                deliver(RuntimeError(f"generation failed: {exc}"))

    def _fail_all(self, exc: BaseException) -> None:
        for seq_id in list(self._deliver):
            self.engine.abort(seq_id)
        self._fail(list(self._deliver), exc)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Hand a value to a caller's event loop; a caller whose loop has closed is gone, so the
    value is dropped (its request was or will be aborted)."""
    with contextlib.suppress(RuntimeError):  # raised when the loop is closed
        loop.call_soon_threadsafe(fn, *args)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
