"""An immutable set of non-negative int64 ids as a bit array, which FAISS filters by directly."""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixrag.retrieval.faiss_internals import faiss


class IdBitmap:
    """Ids as bits (bit i of byte i >> 3 is id i, LSB first): 1 bit per id up to the largest.

    Membership inside a FAISS search is one byte load (IDSelectorBitmap), with nothing to build
    per query. Updates return a new bitmap and never change this one, so a search may keep
    reading a bitmap while a writer swaps in its successor.
    """

    __slots__ = ("_bits",)

    def __init__(self, bits: np.ndarray | None = None) -> None:
        self._bits = bits if bits is not None else np.zeros(0, dtype=np.uint8)
        self._bits.setflags(write=False)

    @classmethod
    def from_ids(cls, ids: np.ndarray) -> IdBitmap:
        """The bitmap of `ids` (int, >= 0; repeats are fine)."""
        return cls().with_added(ids)

    def with_added(self, ids: np.ndarray) -> IdBitmap:
        """A new bitmap holding these ids and `ids`."""
        ids = _checked(ids)
        if len(ids) == 0:
            return self
        num_bytes = max(len(self._bits), int(ids.max()) // 8 + 1)
        bits = np.zeros(num_bytes, dtype=np.uint8)
        bits[: len(self._bits)] = self._bits
        np.bitwise_or.at(bits, ids >> 3, (1 << (ids & 7)).astype(np.uint8))
        return IdBitmap(bits)

    def without(self, ids: np.ndarray) -> IdBitmap:
        """A new bitmap holding these ids minus `ids` (ids it lacks are ignored)."""
        ids = _checked(ids)
        ids = ids[ids < 8 * len(self._bits)]
        if len(ids) == 0:
            return self
        bits = self._bits.copy()
        np.bitwise_and.at(bits, ids >> 3, ~(1 << (ids & 7)).astype(np.uint8))
        return IdBitmap(bits)

    def __contains__(self, chunk_id: object) -> bool:
        if not isinstance(chunk_id, int | np.integer) or chunk_id < 0:
            return False
        byte = int(chunk_id) >> 3
        return byte < len(self._bits) and bool(self._bits[byte] >> (int(chunk_id) & 7) & 1)

    def __len__(self) -> int:
        return int(np.unpackbits(self._bits).sum())

    @property
    def is_empty(self) -> bool:
        """True when no id is held."""
        return not self._bits.any()

    @property
    def num_bytes(self) -> int:
        """Memory held by the bits."""
        return int(self._bits.nbytes)

    def ids(self) -> np.ndarray:
        """The ids held, sorted, as int64."""
        return np.flatnonzero(np.unpackbits(self._bits, bitorder="little")).astype(np.int64)

    def selector(self) -> Any:
        """A FAISS IDSelectorBitmap over these bits; keep this bitmap alive while it is used."""
        return faiss.IDSelectorBitmap(len(self._bits), faiss.swig_ptr(self._bits))


def _checked(ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) and ids.min() < 0:
        raise ValueError("ids must be >= 0")
    return ids
