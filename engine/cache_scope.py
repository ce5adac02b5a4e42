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

    def after(self, num_tokens: int) -> CacheScope:
        """The scope of what follows the first ``num_tokens`` tokens (fewer of them public)."""
        return CacheScope(self.namespace, max(0, self.num_public_tokens - num_tokens))
