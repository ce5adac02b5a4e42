"""Whose prefix cache a request reads and writes: a tenant salt and a public head."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CacheScope:
    """A request's scope in the prefix cache: its first ``num_public_tokens`` tokens are cached
    unsalted, so everyone shares their full blocks, and every later block is salted with
    ``namespace``, so no other namespace can match it (or time a hit on it).

    Raises ValueError for a namespace that is not a str or a count that is not an int >= 0.
    """

    namespace: str = ""
    num_public_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str):
            raise ValueError(f"namespace must be a str, got {type(self.namespace).__name__}")
        count = self.num_public_tokens
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"num_public_tokens must be an integer >= 0, got {count!r}")

    def num_public_blocks(self, block_size: int) -> int:
        """Full blocks inside the public head: the ones every namespace shares."""
        return self.num_public_tokens // block_size

    def block_namespace(self, block_index: int, block_size: int) -> bytes:
        """The namespace of full block ``block_index`` (UTF-8): shared (``b""``) while it lies
        inside the public head. The one place the rule lives: the tree, the block manager, the
        replica router and the remote engine all ask here."""
        if block_index < self.num_public_blocks(block_size):
            return b""
        return self.namespace.encode()

    def after(self, num_tokens: int) -> CacheScope:
        """The scope of what follows the first ``num_tokens`` tokens (fewer of them public)."""
        return CacheScope(self.namespace, max(0, self.num_public_tokens - num_tokens))
