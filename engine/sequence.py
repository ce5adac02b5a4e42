"""Per-request state: tokens, progress through the KV cache, and the block table."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from prefixrag.engine.chunks.store import ChunkSpan, check_spans
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life. PREEMPTED ones wait again, to be recomputed."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request: its prompt plus generated tokens, and how far its KV has been written.

    The first ``num_computed_tokens`` tokens have KV in ``block_ids`` (``block_ids[i]`` holds
    positions ``i*block_size`` to ``(i+1)*block_size - 1``). The scheduler owns every field after
    ``arrival_time``; callers read them. ``cache_scope`` says whose prefix cache the request
    reads and writes (see :class:`CacheScope`); ``chunk_spans`` are the prompt's source bodies,
    whose KV the chunk store may supply (see engine/chunks/store.py). Of the prompt,
    ``num_cached_tokens`` came from an exact prefix hit, ``num_blended_tokens`` from cached chunk
    bodies placed at new positions, and ``num_recomputed_tokens`` were cached bodies computed
    again by blending.
    """

    seq_id: int
    token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cache_scope: CacheScope = CacheScope()
    chunk_spans: tuple[ChunkSpan, ...] = ()
    arrival_time: float = 0.0
    num_prompt_tokens: int = field(init=False)
    status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False)
    finish_reason: str | None = field(default=None, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)
    num_blended_tokens: int = field(default=0, init=False)
    num_recomputed_tokens: int = field(default=0, init=False)
    block_ids: list[int] = field(default_factory=list, init=False)
    arrival_order: int = field(default=-1, init=False)
    num_preemptions: int = field(default=0, init=False)
    enqueue_step: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.seq_id, bool) or not isinstance(self.seq_id, int):
            raise ValueError(f"seq_id must be an integer, got {self.seq_id!r}")
        if not isinstance(self.token_ids, list | tuple) or not self.token_ids:
            raise ValueError("a sequence needs a non-empty list of prompt token ids")
        for t in self.token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"token ids must be integers >= 0, got {t!r}")
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if not isinstance(self.cache_scope, CacheScope):
            raise ValueError("cache_scope must be a CacheScope")
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.chunk_spans = check_spans(self.chunk_spans, self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        """The newest token (the next one to compute while decoding)."""
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not written yet."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once the sequence finished, was stopped or was aborted."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add one generated token."""
        self.token_ids.append(token_id)
