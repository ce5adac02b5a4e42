"""The service between HTTP and the engine: engine config from settings, prompt checks, streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixrag.app.core.errors import InvalidInputError, PromptTooLongError, QueueFullError
from prefixrag.app.core.settings import Settings
from prefixrag.app.services.gguf_hub import local_llm
from prefixrag.engine.chunks.store import ChunkSpan
from prefixrag.engine.config import EngineConfig
from prefixrag.engine.kv_cache.cache_scope import CacheScope
from prefixrag.engine.outputs import GenerationDelta, GenerationResult
from prefixrag.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from prefixrag.app.replicas.remote_engine import RemoteEngine
    from prefixrag.engine.async_engine import AsyncEngine


def engine_config_from_settings(settings: Settings) -> EngineConfig:
    """The engine's plain config, built from the service settings (a hub model is fetched
    into the local cache first, once)."""
    return EngineConfig(
        model=local_llm(settings.resolved_llm),
        block_size=settings.block_size,
        kv_cache_gb=settings.kv_cache_gb,
        gpu_memory_fraction=settings.gpu_memory_fraction,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_cache=settings.prefix_cache,
        attention_backend=settings.attention_backend,
        dtype=settings.dtype,
        kv_cache_dtype=settings.kv_cache_dtype,
        weight_quant=settings.weight_quant,
        cache_dir=str(settings.cache_dir / "models"),
        enable_chunk_reuse=settings.chunk_reuse,
        chunk_recompute_fraction=settings.chunk_recompute_fraction,
        chunk_select_layer=settings.chunk_select_layer,
        chunk_host_bytes=int(settings.chunk_host_gb * 2**30),
        chunk_disk_dir=str(settings.chunk_disk_dir) if settings.chunk_disk_gb > 0 else None,
        chunk_disk_bytes=int(settings.chunk_disk_gb * 2**30),
        cuda_graphs=settings.cuda_graphs,
        int8_activations=settings.int8_activations,
    )


def document_tag(document_id: int) -> str:
    """The chunk-store tag of a document's bodies."""
    return f"doc:{document_id}"


def model_id_for(path: str) -> str:
    """The name clients use for a model: its file or folder name without a GGUF suffix."""
    name = Path(path).name
    return name.removesuffix(".gguf")


class LLMService:
    """Generation for the HTTP layer: fits prompts into the context window and streams results,
    from the embedded engine or from engine replicas (the same calls either way)."""

    def __init__(
        self,
        engine: AsyncEngine | RemoteEngine,
        model_id: str,
        settings: Settings,
        on_result: Callable[[GenerationResult], None] | None = None,
    ) -> None:
        self.engine = engine
        self.model_id = model_id
        self.settings = settings
        self.on_result = on_result  # sees every finished generation (the metrics)
        # generations started and not yet finished; touched only on the event loop's thread
        self.num_active = 0

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.tokenizer.vocab_size

    def token_text(self, token_id: int) -> str:
        """One token's text, as the logprobs of a response name it."""
        return self.engine.tokenizer.decode([token_id])

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def resolve_max_tokens(self, requested: int | None, default: int | None = None) -> int:
        """The max_tokens a request gets: `default` (else the settings' default_max_tokens, and
        never past `max_tokens_cap`) when it names none, InvalidInputError (422) past
        `max_tokens_cap`."""
        if requested is None:
            default = self.settings.default_max_tokens if default is None else default
            return min(default, self.settings.max_tokens_cap)
        if requested > self.settings.max_tokens_cap:
            raise InvalidInputError(
                f"max_tokens must be at most {self.settings.max_tokens_cap}, got {requested}"
            )
        return requested

    def fit_max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """The max_tokens to use next to a prompt of `num_prompt_tokens`: the default shrinks to
        the room left; PromptTooLongError when the request cannot fit."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {num_prompt_tokens} tokens. Shorten the prompt.",
                param="prompt",
            )
        max_tokens = self.resolve_max_tokens(requested)
        if requested is None:
            return min(max_tokens, room)
        if max_tokens > room:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens; you asked "
                f"for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion). Shorten the prompt or lower max_tokens.",
                param="max_tokens",
            )
        return max_tokens

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        cache_scope: CacheScope = CacheScope(),
        chunk_spans: tuple[ChunkSpan, ...] = (),
    ) -> AsyncIterator[GenerationDelta | GenerationResult]:
        """The engine's stream for this prompt, its prefix cache scoped by `cache_scope` (the
        tenant's salt past a public head), `chunk_spans` naming its source bodies for the
        chunk KV store. QueueFullError (429) when `max_queued_requests` generations are
        already waiting or running."""
        limit = self.settings.max_queued_requests
        if self.num_active >= limit:
            # one engine batch of max_num_seqs drains at a time: wait about one per batch ahead
            batches_ahead = self.num_active // max(1, self.settings.max_num_seqs)
            raise QueueFullError(
                f"{self.num_active} generations are queued (the limit is {limit}); retry later",
                retry_after=1 + batches_ahead,
            )
        stream = self.engine.generate(
            prompt_ids, params, cache_scope=cache_scope, chunk_spans=chunk_spans
        )
        return self._counted(stream)

    def cached_prefix_len(self, prompt_ids: list[int], cache_scope: CacheScope) -> int:
        """Leading tokens of `prompt_ids` the engine's prefix cache holds for `cache_scope`."""
        return self.engine.cached_prefix_len(prompt_ids, cache_scope)

    def engine_stats(self) -> dict[str, dict[str, int]]:
        """The engine's cache counters and gauges by replica name; the embedded engine's name
        is "" (blocking with replicas: call it off the event loop)."""
        by_replica = getattr(self.engine, "stats_by_replica", None)
        return by_replica() if by_replica is not None else {"": self.engine.stats()}

    def memory_plan(self) -> dict[str, int] | None:
        """The embedded engine's memory plan in bytes (weights, KV pool, chunk host tier,
        scratch, available), or None with replicas (each plans for itself)."""
        return getattr(self.engine, "memory_plan", None)

    def replicas(self) -> list[dict[str, Any]] | None:
        """Each engine replica and its state, or None for the embedded engine (blocking)."""
        replicas = getattr(self.engine, "replicas", None)
        return replicas() if replicas is not None else None

    async def forget_document(self, tenant: str, document_id: int) -> int:
        """Drop a deleted document's chunk bodies from the engine's chunk KV store."""
        return await self.engine.drop_chunks(tenant, document_tag(document_id))

    async def _counted(
        self, stream: AsyncIterator[GenerationDelta | GenerationResult]
    ) -> AsyncIterator[GenerationDelta | GenerationResult]:
        # Counted from the first read, so a stream that is never read cannot leak a slot.
        self.num_active += 1
        try:
            async for item in stream:
                if isinstance(item, GenerationResult) and self.on_result is not None:
                    self.on_result(item)
                yield item
        finally:
            self.num_active -= 1
            await stream.aclose()  # type: ignore[attr-defined]
