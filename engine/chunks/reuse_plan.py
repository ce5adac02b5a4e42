"""What a prompt reuses from the chunk store: which cached bodies go where. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixrag.engine.chunks.store import ChunkEntry


@dataclass(frozen=True, slots=True)
class ReuseHit:
    """A cached body placed at ``start`` in this prompt; its KV lies in ``block_ids`` (token i in
    block ``i // block_size``) and was computed with its first token at ``base_pos``."""

    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    base_pos: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(slots=True)
class ReusePlan:
    """The hits of one prefill step, with the store entries it holds until the step is done."""

    hits: list[ReuseHit] = field(default_factory=list)
    entries: list[ChunkEntry] = field(default_factory=list)

    @property
    def num_reused_tokens(self) -> int:
        return sum(hit.num_tokens for hit in self.hits)
